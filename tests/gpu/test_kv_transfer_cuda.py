"""The KV transport on CUDA (common/kv_transfer/): a Mooncake sender has the prefill worker stage a
handoff's KV in device memory without waiting for the device, then registers that memory (as over
RDMA) or a host copy made on the transfer thread (as over TCP) and writes it into device pools,
whole or split by KV heads for a tensor-parallel decode side; the bytes fallback copies the same
device handoff to the host itself. Marked `gpu` (bench.gpu_check runs them); the Mooncake
case also needs the engine's CUDA build, loadable here (bench/gpu_carry.sh puts it on PYTHONPATH)."""

from __future__ import annotations

import pytest
import torch

from common.engine.handoff import HandoffRequest
from common.engine.kv_pool import KVPool
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.kv_transfer import grpc_bytes, mooncake, plan
from common.wire.kv_chunks import KvAssembler
from common.wire.proto_gen import prefill_pb2
from prefill_service.worker import PrefillWorker

PROMPT = list(range(5, 45))


def _device_handoff(path: str, staging: torch.device):
    """(runner, handoff) of PROMPT prefilled on CUDA, the KV copied out to `staging`; the copy-out
    (gather and handoff) runs with CUDA's sync check on: it must not wait for the device."""
    runner = ModelRunner(RunnerArgs(path, device="cuda", dtype="float32", max_total_tokens=256, max_running_requests=2))
    worker = PrefillWorker(runner, chunk_size=64, radix_cache=False, staging=staging)

    def checked(fn):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    worker._copy_out, worker._to_handoff = checked(worker._copy_out), checked(worker._to_handoff)
    [handoff] = worker.prefill([HandoffRequest("r", PROMPT, SamplingParams(max_new_tokens=1), 0)])
    return runner, handoff


def _bytes_back(handoff, max_bytes: int) -> list[torch.Tensor]:
    """K + V as the bytes path sends them, assembled on the host."""
    layers, heads, dim = len(handoff.k), handoff.k[0].shape[1], handoff.k[0].shape[2]
    assembler = KvAssembler(handoff.prompt_len, layers, heads, dim)
    for message in grpc_bytes.kv_messages(handoff, max_bytes):
        assembler.add(message.kv)
    k, v = assembler.finish()
    return k + v


@pytest.mark.gpu
def test_device_staged_kv_falls_back_to_bytes_through_the_host(checkpoint):
    _, handoff = _device_handoff(checkpoint("llama"), torch.device("cuda"))
    assert handoff.k[0].is_cuda and handoff.kv_ready is not None
    got = _bytes_back(handoff, 4096)
    assert all(not t.is_cuda for t in got)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(got, handoff.k + handoff.v))


@pytest.mark.gpu
@pytest.mark.skipif(mooncake.available() is not None, reason="no loadable Mooncake engine here")
@pytest.mark.parametrize("reads_device", [True, False])
def test_mooncake_writes_device_staged_kv_into_device_pools(checkpoint, reads_device):
    """reads_device: the engine registers the device-staged KV itself (what RDMA does; the CUDA
    build's TCP transport takes device memory too), or it gets a host copy made on the transfer
    thread (what TCP does)."""
    sender = mooncake.MooncakeSender(mooncake.TransferEngine("127.0.0.1"))
    assert not sender.reads_device  # a TCP engine
    sender.reads_device = reads_device
    staging = sender.staging_device(torch.device("cuda"))
    _, handoff = _device_handoff(checkpoint("llama"), staging)
    assert staging.type == "cuda" and handoff.k[0].is_cuda and handoff.kv_ready is not None
    whole_k, whole_v = torch.stack(handoff.k).cpu(), torch.stack(handoff.v).cpu()
    layers, heads, dim = whole_k.shape[0], whole_k.shape[2], whole_k.shape[3]
    decode = mooncake.TransferEngine("127.0.0.1")  # the decode side: device pools registered once
    slots = [int(s) for s in torch.randperm(200, generator=torch.Generator().manual_seed(0))[: len(PROMPT)] + 1]
    runs = plan.slot_runs(slots)

    pool = KVPool(256, layers, heads, dim, torch.float32, device="cuda")
    decode.register(pool.k + pool.v)
    dest = prefill_pb2.KvDestination(session=decode.session, target=plan.kv_region(pool.k, pool.v))
    dest.runs.extend(runs)
    label, messages = sender.messages("r", dest, handoff, 1 << 12, lambda: False)
    notices = [m.written for m in messages]
    assert label == "mooncake" and sum(n.bytes for n in notices) == 2 * whole_k.numel() * 4
    assert torch.equal(pool.k_all[:, slots].cpu(), whole_k) and torch.equal(pool.v_all[:, slots].cpu(), whole_v)

    # a tensor-parallel decode side of two ranks, one KV head each: each gets its head (sliced on the device)
    ranks = [KVPool(256, layers, 1, dim, torch.float32, device="cuda") for _ in range(heads)]
    tp = prefill_pb2.KvDestination()
    for h, p in enumerate(ranks):
        decode.register(p.k + p.v)
        tp.tp_ranks.add(session=decode.session, target=plan.kv_region(p.k, p.v), kv_head_start=h, kv_head_count=1)
    tp.runs.extend(runs)
    label, messages = sender.messages("t", tp, handoff, 1 << 12, lambda: False)
    assert label == "mooncake" and len(list(messages)) > 0
    for h, p in enumerate(ranks):
        assert torch.equal(p.k_all[:, slots].cpu(), whole_k[:, :, h : h + 1])
        assert torch.equal(p.v_all[:, slots].cpu(), whole_v[:, :, h : h + 1])

    label, messages = sender.messages("b", None, handoff, 1 << 12, lambda: False)  # no destination: bytes
    assert label == "grpc" and all(m.HasField("kv") for m in messages)


@pytest.mark.gpu
@pytest.mark.skipif(mooncake.available() is not None, reason="no loadable Mooncake engine here")
def test_a_mooncake_pair_on_cuda_serves_hf_greedys_tokens(checkpoint):
    """Both services on CUDA with Mooncake: prefill's handoffs stay in device memory and are written
    from there into decode's device pool; the tokens are HF greedy's."""
    from tests.grpc_harness import GrpcPair

    path = checkpoint("llama")
    kw = dict(device="cuda", dtype="float32")
    pair = GrpcPair(path, prefill_kw=kw, decode_kw=kw, transfer="mooncake")
    try:
        assert pair.prefill.worker.staging.type == "cuda"
        pair.check_against_oracle(path, [[5, 6, 7, 8, 9], list(range(10, 47)), list(range(100, 160))], 8, rid="m")
        assert pair.prefill.kv_notices > 0  # written by the engine, not sent as bytes
    finally:
        pair.close()
