"""The address-writing KV backends (mooncake, shm; common/kv_transfer/): the neutral write plan, the
engine's registration spans, and aborts while a replica writes into reserved slots."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.kv_transfer import mooncake, plan
from common.wire.proto_gen import prefill_pb2
from decode_service.req import ReqState
from prefill_service import handoff_stream
from prefill_service.hooks import Delays
from tests.grpc_harness import GrpcPair, needs_mooncake
from tests.oracle import hf_greedy


def test_slot_runs_coalesce_consecutive_slots():
    runs = plan.slot_runs([7, 8, 9, 3, 4, 11])
    assert [(r.token_start, r.slot, r.length) for r in runs] == [(0, 7, 3), (3, 3, 2), (5, 11, 1)]


def _covered(tensor, ptrs, lens) -> bool:
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return any(p <= start and end <= p + n for p, n in zip(ptrs, lens))


def test_registration_merges_the_layers_of_one_buffer_into_one_span():
    """A pool's (or a handoff's) layers are views of one buffer: one span each for K and V, not one
    per layer; a view inside a registered tensor adds nothing; every byte is covered once."""
    from common.engine.kv_pool import KVPool

    pool = KVPool(10, 3, 2, 4, torch.float32)
    ptrs, lens = mooncake._spans(pool.k + pool.v)
    assert len(ptrs) <= 2 and sum(lens) == pool.nbytes and all(_covered(t, ptrs, lens) for t in pool.k + pool.v)
    whole = torch.zeros(8)
    ptrs, lens = mooncake._spans([whole, whole[2:5]])
    assert (ptrs, lens) == ([whole.data_ptr()], [32])


def test_write_plan_addresses_every_token_of_every_layer_once():
    layers, n, shape = 2, 6, (2, 4)
    k = [torch.randn(n, *shape) for _ in range(layers)]
    v = [torch.randn(n, *shape) for _ in range(layers)]
    pool_k = [torch.zeros(16, *shape) for _ in range(layers)]
    pool_v = [torch.zeros(16, *shape) for _ in range(layers)]
    region = plan.kv_region(pool_k, pool_v)
    slots = [7, 8, 9, 3, 4, 11]
    runs = plan.slot_runs(slots)
    written = []
    for t0, nt in ((0, 4), (4, 2)):  # two chunks of tokens, all layers
        srcs, dsts, lens = plan.write_plan(k, v, region, runs, t0, nt, 0, layers)
        for src, dst, length in zip(srcs, dsts, lens):  # stand in for the engine: copy bytes by address
            ctypes_copy(dst, src, length)
            written.append(length)
    for layer in range(layers):
        assert torch.equal(pool_k[layer][slots], k[layer]) and torch.equal(pool_v[layer][slots], v[layer])
    assert sum(written) == 2 * layers * n * region.slot_bytes


def ctypes_copy(dst: int, src: int, length: int) -> None:
    import ctypes

    ctypes.memmove(dst, src, length)


def test_a_destination_that_does_not_match_is_refused():
    dest = prefill_pb2.KvDestination(session="x:1", target=prefill_pb2.KvRegion(k_ptrs=[1], v_ptrs=[2], slot_bytes=32))
    dest.runs.extend(plan.slot_runs([5, 6, 7]))
    plan.check_destination(dest, dest.target, 3, 1, 32)
    with pytest.raises(ValueError, match="covers 3 tokens"):
        plan.check_destination(dest, dest.target, 4, 1, 32)
    with pytest.raises(ValueError, match="layers"):
        plan.check_destination(dest, dest.target, 3, 2, 32)
    with pytest.raises(ValueError, match="layers"):
        plan.check_destination(dest, dest.target, 3, 1, 64)


@pytest.mark.parametrize("transfer", [pytest.param("mooncake", marks=needs_mooncake), "shm"])
def test_abort_while_kv_is_written_holds_the_slots_until_the_writes_end(checkpoint, transfer, monkeypatch):
    """Decode has room for one request only. A is aborted while its replica writes KV into its slots:
    the client hears "abort" at once, the slots stay reserved until the replica's call has ended (no
    late write can reach them), then B takes the same slots and is exact; nothing leaks."""
    mid_write, go_on = threading.Event(), threading.Event()

    class HeldOutbox(handoff_stream.Outbox):  # A's writes pause after the first ones until the test says
        takes = 0

        def take(self):
            HeldOutbox.takes += 1
            if HeldOutbox.takes == 2:
                mid_write.set()
                assert go_on.wait(60), "the test never let A's writes go on"
            return super().take()

    monkeypatch.setattr(handoff_stream, "Outbox", HeldOutbox)
    path = checkpoint("llama")
    prompt_a, prompt_b = list(range(5, 45)), list(range(50, 90))
    pair = GrpcPair(
        path,
        prefill_kw=dict(max_chunk_bytes=512),
        prefill_hooks=Delays(kv_message_s=0.05),
        decode_kw=dict(max_total_tokens=48, max_running_requests=1),
        transfer=transfer,
    )
    sched = pair.decode.scheduler
    try:
        call_a = pair.generate(prompt_a, 8, stream=True, rid="a", ignore_eos=True)
        assert next(call_a).chunk.token_ids  # A's first token
        assert mid_write.wait(30), "A's KV writes never began"  # held mid-way until after the abort
        reply = pair.stub.Abort(pb.AbortRequest(request_id="a"))
        assert reply.success
        _, complete = pair.collect(call_a)
        assert complete.finish_reason == "abort"
        [held] = sched.reqs_in(ReqState.AWAITING_HANDOFF)  # finished for the client, its slots still reserved
        assert held.finished and held.kv_slots is not None
        go_on.set()
        started = time.monotonic()
        ids, complete = pair.collect(pair.generate(prompt_b, 8, rid="b", ignore_eos=True))
        assert time.monotonic() - started >= pair.decode.kv_receiver.quiesce_s * 0.9
        assert ids == hf_greedy(path, prompt_b, 8) and complete.finish_reason == "length"
        pair.wait_idle()
    finally:
        go_on.set()
        pair.close()


@pytest.mark.parametrize(
    "transfer,prefill_backend",
    [
        pytest.param("mooncake", "grpc", marks=needs_mooncake),
        ("shm", "grpc"),
        pytest.param("shm", "mooncake", marks=needs_mooncake),
        ("shm", "shm-elsewhere"),  # a prefill replica whose shared-memory folder is not decode's
    ],
)
def test_a_replica_without_the_engine_falls_back_to_sending_bytes(checkpoint, tmp_path, transfer, prefill_backend):
    path = checkpoint("qwen2")
    prefill_kw = dict(disaggregation_transfer_backend=prefill_backend, disaggregation_network_private=True)
    if prefill_backend == "shm-elsewhere":
        prefill_kw = dict(disaggregation_transfer_backend="shm", disaggregation_shm_dir=str(tmp_path))
    pair = GrpcPair(path, prefill_kw=prefill_kw, transfer=transfer)
    try:
        pair.check_against_oracle(path, [[5, 6, 7, 8], list(range(9, 40))], 6, rid="f")
        assert pair.prefill.kv_notices == 0 and pair.decode.kv_receiver is not None
    finally:
        pair.close()


def test_both_services_refuse_mooncake_where_the_engine_cannot_load(checkpoint, monkeypatch):
    from decode_service.config import DecodeConfig
    from decode_service.server import DecodeService
    from prefill_service.config import PrefillConfig
    from prefill_service.server import PrefillService

    monkeypatch.setattr(mooncake, "available", lambda: mooncake.INSTALL_HINT)
    path = checkpoint("qwen2")
    for service, config in ((PrefillService, PrefillConfig), (DecodeService, DecodeConfig)):
        with pytest.raises(mooncake.MooncakeUnavailable, match="pip install mooncake-transfer-engine"):
            service(
                config(path, port=0, disaggregation_transfer_backend="mooncake", disaggregation_network_private=True)
            )


@pytest.mark.parametrize(
    "tokens,layers,per,bound", [(480, 16, 2048, 4 << 20), (480, 16, 2048, 256 << 10), (7, 2, 100, 250)]
)
def test_the_layer_first_plan_covers_every_cell_once_within_the_bound(tokens, layers, per, bound):
    cells = []
    for t0, nt, l0, nl in plan.plan_by_layer(tokens, layers, per, bound):
        assert nt * nl * per <= max(bound, per)
        assert nl == 1 or nt == tokens  # several layers only with every token: one piece per layer and run
        cells += [(t, layer) for t in range(t0, t0 + nt) for layer in range(l0, l0 + nl)]
    assert sorted(cells) == [(t, layer) for t in range(tokens) for layer in range(layers)]


def test_mooncake_is_refused_unless_the_network_is_declared_private(checkpoint):
    """The engine binds every interface whatever --host says and serves its registered memory to any peer
    (a review's keyless engine read and overwrote another request's KV): both services refuse it at start,
    before the model loads, unless the operator passes --disaggregation-network-private."""
    from decode_service.config import DecodeConfig
    from decode_service.server import DecodeService
    from prefill_service.config import PrefillConfig
    from prefill_service.server import PrefillService

    path = checkpoint("qwen2")
    for service, config in ((PrefillService, PrefillConfig), (DecodeService, DecodeConfig)):
        with pytest.raises(ValueError, match="--disaggregation-network-private"):
            service(config(path, port=0, disaggregation_transfer_backend="mooncake"))
