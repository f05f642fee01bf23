"""End to end over real gRPC on 127.0.0.1: prefill service -> decode service -> client."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
import torch
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from decode_service.req import ReqState
from prefill_service.hooks import Delays
from tests.grpc_harness import GrpcPair, needs_mooncake, wait_for
from tests.oracle import hf_greedy


def _prompts(n: int, seed: int = 21) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 384, (int(k),), generator=g).tolist() for k in torch.randint(1, 60, (n,), generator=g)]


TRANSFERS = ["grpc", pytest.param("mooncake", marks=needs_mooncake), "shm"]


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("overlap", [True, False])
def test_sixteen_concurrent_requests_match_hf(checkpoint, arch, overlap, transfer):
    path = checkpoint(arch)
    prompts = _prompts(16)
    pair = GrpcPair(path, overlap=overlap, prefill_kw=dict(max_chunk_bytes=8192), transfer=transfer)
    try:

        def run(i):
            stream = i % 2 == 0
            return pair.collect(pair.generate(prompts[i], 12 + i % 5, stream=stream, rid=f"r{i}", ignore_eos=True))

        with futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(run, range(16)))
    finally:
        pair.close()
    assert (pair.prefill.kv_notices > 0) == (transfer != "grpc")  # the KV took the data plane asked for
    for i, (ids, complete) in enumerate(results):
        assert ids == hf_greedy(path, prompts[i], 12 + i % 5), f"request {i}"
        assert complete.finish_reason == "length" and complete.completion_tokens == len(ids)
        assert complete.prompt_tokens == len(prompts[i]) and list(complete.output_ids) == ids


def test_bad_requests_get_invalid_argument_before_any_data(checkpoint):
    pair = GrpcPair(checkpoint("qwen2"), decode_kw=dict(context_length=256))
    cases = [
        ([], {}, "empty prompt"),
        ([5, 10_000], {}, "vocabulary"),
        ([5] * 300, {}, "context"),
        ([5] * 200, dict(max_new_tokens=100), "exceeds the context"),
        ([5], dict(n=129), "n must be in [1, 128]"),
        ([5], dict(stop=["x" * 300]), "stop"),
        ([5], dict(regex="(a+"), "regex"),  # does not compile
        ([5], dict(frequency_penalty=2.5), "frequency_penalty"),
        ([5], dict(temperature=-1.0), "temperature"),
    ]
    try:
        for prompt, sampling, message in cases:
            received = []
            with pytest.raises(grpc.RpcError) as err:
                for r in pair.generate(prompt, **sampling):
                    received.append(r)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert message in err.value.details() and not received
    finally:
        pair.close()


@pytest.mark.parametrize("reservation", ["full", "on-demand"])
def test_default_max_new_tokens_is_clamped_to_the_context(checkpoint, reservation):
    """Without max_new_tokens a request runs to the end of the context on demand (OpenAI's reading of a
    missing max_tokens); with the full reservation it takes --default-max-new-tokens."""
    path = checkpoint("llama")
    kw = dict(default_max_new_tokens=50, context_length=64, decode_kv_reservation=reservation)
    pair = GrpcPair(path, decode_kw=kw)
    try:
        ids, complete = pair.collect(pair.generate([5] * 60, ignore_eos=True))
        assert len(ids) == 4 and complete.finish_reason == "length"
        ids, _ = pair.collect(pair.generate([5, 6, 7], ignore_eos=True))
        assert len(ids) == (50 if reservation == "full" else 61)
    finally:
        pair.close()


def test_cancelled_and_aborted_requests_free_their_slots(checkpoint):
    pair = GrpcPair(checkpoint("qwen3"), prefill_kw=dict(max_chunk_bytes=512), prefill_hooks=Delays(kv_message_s=0.01))
    sched, reasons = pair.decode.scheduler, {}
    finish = sched.finish
    sched.finish = lambda req, reason, *a, **k: (
        reasons.__setitem__(req.rid.split("#")[0], reason),
        finish(req, reason, *a, **k),
    )
    try:
        call = pair.generate([5, 6, 7, 8], 200, stream=True, rid="cancel-me", ignore_eos=True)
        next(call)  # at least one token streamed
        call.cancel()
        aborted = pair.generate([9, 10, 11], 200, stream=True, rid="abort-me", ignore_eos=True)
        next(aborted)
        assert pair.stub.Abort(pb.AbortRequest(request_id="abort-me")).success
        rest = list(aborted)
        assert rest[-1].complete.finish_reason == "abort" and rest[-1].complete.completion_tokens < 200
        assert not pair.stub.Abort(pb.AbortRequest(request_id="abort-me")).success  # finished: still OK
        # cancelled while its handoff is still in flight (KV chunks are slow)
        slow = pair.generate([5] * 40, 10, stream=True, rid="in-flight")
        time.sleep(0.05)
        slow.cancel()
        pair.wait_idle()
        assert reasons == {"cancel-me": "abort", "abort-me": "abort", "in-flight": "abort"}
    finally:
        pair.close()  # waits for idle and checks pool integrity


def test_first_token_arrives_while_the_handoff_is_in_flight(checkpoint):
    path = checkpoint("llama")
    prompt = list(range(5, 45))
    pair = GrpcPair(path, prefill_kw=dict(max_chunk_bytes=1024), prefill_hooks=Delays(kv_message_s=0.05))
    try:
        call = pair.generate(prompt, 8, stream=True, ignore_eos=True)
        first = next(call)
        assert list(first.chunk.token_ids) == hf_greedy(path, prompt, 1)
        in_flight = pair.decode.scheduler.reqs_in(ReqState.AWAITING_HANDOFF)
        rest, complete = pair.collect(call)
        assert in_flight, "the first token came only after the handoff completed"
        assert list(first.chunk.token_ids) + rest == hf_greedy(path, prompt, 8)
    finally:
        pair.close()


def test_large_handoff_is_chunked_within_the_bound(tmp_path):
    from common.tools.tiny_checkpoint import build

    path = build(str(tmp_path / "wide"), "llama", hidden_size=512, num_layers=8)
    prompt = [(7 * i) % 370 + 5 for i in range(300)]  # 300 tokens x 16 KiB of KV (8 layers, fp32)
    bound = 1 << 20
    pair = GrpcPair(
        path, prefill_kw=dict(max_chunk_bytes=bound, max_total_tokens=1024), decode_kw=dict(max_total_tokens=1024)
    )
    try:
        stub = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(pair.prefill.address))
        chunks = [
            c.kv
            for c in stub.Prefill(prefill_pb2.PrefillRequest(request_id="x", input_ids=prompt))
            if c.WhichOneof("payload") == "kv"
        ]
        sizes = [len(c.k.data) + len(c.v.data) for c in chunks]
        assert sum(sizes) > 4 << 20 and len(chunks) >= 5 and max(sizes) <= bound
        ids, _ = pair.collect(pair.generate(prompt, 6, ignore_eos=True))
        assert ids == hf_greedy(path, prompt, 6)
    finally:
        pair.close()


def test_kv_chunks_waiting_to_be_written_stay_bounded_per_call(checkpoint):
    """While decode's stream does not take KV chunks, a call hands over at most MAX_PENDING_CHUNKS
    and then stops reading its stream (so gRPC flow control holds the replica back); once the stream
    takes them again, the request finishes exactly."""
    import threading

    from decode_service.prefill_client import MAX_PENDING_CHUNKS

    path = checkpoint("llama")
    prompt = list(range(5, 45))
    pair = GrpcPair(path, prefill_kw=dict(max_chunk_bytes=512))
    worker = pair.decode.scheduler.worker
    write, held, release = worker.write_kv_chunk, [], threading.Event()

    def held_write(*args, **kwargs):
        if not release.is_set():
            held.append((args, kwargs))
            return
        write(*args, **kwargs)

    worker.write_kv_chunk = held_write
    try:
        call = pair.generate(prompt, 6, stream=True, rid="w", ignore_eos=True)
        wait_for("no KV chunk reached the worker", lambda: len(held) == MAX_PENDING_CHUNKS)
        time.sleep(0.3)  # had the window not held, more chunks would have arrived by now
        assert len(held) == MAX_PENDING_CHUNKS
        release.set()
        for args, kwargs in held:
            write(*args, **kwargs)
        ids, _ = pair.collect(call)
        assert ids == hf_greedy(path, prompt, 6)
    finally:
        release.set()
        pair.close()
