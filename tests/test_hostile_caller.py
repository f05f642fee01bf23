"""A hostile caller on 127.0.0.1 (issue 37, items 4 and 6): absurd chunk sizes, huge or wrong tp_ranks,
more open calls than the cap, too many stop ids, an unauthenticated large body. Each is refused with
its own status code, and the pair keeps serving ordinary requests exactly (HF greedy's tokens, pools
balanced). Also: a FIFO named like a pool file does not block the start-up sweep."""

from __future__ import annotations

import os
import threading

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.kv_transfer import shm_files
from common.wire import security
from common.wire.aio_server import AioServer
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from decode_service.prefill_replicas import PREFILL_METHOD
from decode_service.request_validation import InvalidRequest, parse_generate
from tests.gated_pool import GatedPool
from tests.grpc_harness import GrpcPair, held_worker, wait_for

KEY = "inside"


def keyed() -> tuple:
    """A fresh internal token for one Prefill call (each is admitted once: security.py)."""
    return security.signed_metadata(KEY, PREFILL_METHOD)


PROMPT = [5, 6, 7, 8]


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(call())
    return err.value


def _request(**kw) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(request_id="hostile", input_ids=PROMPT, **kw)


def _complete(stream) -> prefill_pb2.PrebuiltRecord:
    """The record of a Prefill stream that ran to its end."""
    messages = list(stream)
    assert messages[-1].HasField("record"), messages[-1]
    return messages[-1].record


@pytest.fixture(scope="module")
def pair(checkpoint):
    pair = GrpcPair(
        checkpoint("llama"),
        prefill_kw=dict(internal_api_key=KEY, max_open_calls=2),
        decode_kw=dict(internal_api_key=KEY),
    )
    yield pair
    pair.close()  # waits for idle and checks decode's pools balance


@pytest.fixture
def stub(pair):
    channel = grpc.insecure_channel(pair.prefill.address)
    yield prefill_pb2_grpc.PrefillStub(channel)
    channel.close()


@pytest.fixture
def serves_exactly(pair, checkpoint):
    """After the test's hostile calls, ordinary requests still get HF greedy's tokens."""
    yield
    pair.check_against_oracle(checkpoint("llama"), [PROMPT, [9, 10, 11, 12, 13]], 6)


@pytest.mark.parametrize("size", [1, 4096, (256 << 10) - 1, (32 << 20) + 1, (1 << 32) - 1])
def test_absurd_chunk_sizes_are_refused(stub, serves_exactly, size):
    err = _refused(lambda: stub.Prefill(_request(max_chunk_bytes=size), metadata=keyed(), timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_chunk_bytes" in err.details(), err.details()


def test_a_chunk_size_within_the_range_is_served(stub):
    assert _complete(stub.Prefill(_request(max_chunk_bytes=256 << 10), metadata=keyed(), timeout=30)).prompt_len == 4


def test_tp_ranks_outside_the_models_layouts_are_refused_before_any_copy(pair, stub, serves_exactly):
    heads = pair.prefill.runner.config.num_kv_heads  # the tiny llama: 2 KV heads, 4 attention heads
    whole = prefill_pb2.KvRankDestination(session="127.0.0.1:1", kv_head_start=0, kv_head_count=heads)
    huge = prefill_pb2.KvDestination(tp_ranks=[whole] * 5000)  # 5000 copies of the KV, were it taken
    one_head = prefill_pb2.KvRankDestination(session="127.0.0.1:1", kv_head_start=0, kv_head_count=1)
    wrong = prefill_pb2.KvDestination(tp_ranks=[one_head, one_head])  # rank 1 of 2 holds head 1, not 0
    for dest, says in ((huge, "5000 ranks"), (wrong, "tp_ranks[1]")):
        err = _refused(lambda d=dest: stub.Prefill(_request(kv_destination=d), metadata=keyed(), timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.details(), err.details()


def test_too_many_stop_ids_are_refused_on_both_services(pair, stub, serves_exactly):
    many = list(range(65))  # each in the vocabulary: only their number is wrong
    params = prefill_pb2.SamplingParams(stop_token_ids=many)
    err = _refused(lambda: stub.Prefill(_request(sampling_params=params), metadata=keyed(), timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in err.details(), err.details()
    err = _refused(lambda: pair.generate(PROMPT, 4, stop_token_ids=many))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in err.details(), err.details()
    ids, _ = pair.collect(pair.generate(PROMPT, 4, stop_token_ids=many[:64]))  # 64 are allowed
    assert 1 <= len(ids) <= 4


def test_the_front_door_counts_stop_ids_itself():
    """Decode refuses them at validation, before a slot is reserved or a prefill replica is asked."""
    sp = pb.SamplingParams(max_new_tokens=4, stop_token_ids=list(range(65)))
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT), sampling_params=sp)
    with pytest.raises(InvalidRequest, match="stop_token_ids has 65 ids; at most 64"):
        parse_generate(request, context_length=256, default_max_new_tokens_=8)
    del request.sampling_params.stop_token_ids[64:]
    assert len(parse_generate(request, 256, 8)[1].stop_token_ids) == 64


def test_more_open_calls_than_the_cap_are_refused(pair, stub, serves_exactly):
    service = pair.prefill
    in_step, latch = held_worker(service)
    try:
        first = stub.Prefill(_request(), metadata=keyed(), timeout=60)  # prefilling: its step is held
        assert in_step.wait(20), "the first call never reached the worker"
        second = stub.Prefill(_request(), metadata=keyed(), timeout=60)  # queued behind it
        wait_for("two calls open", lambda: service.open_calls == 2)
        err = _refused(lambda: stub.Prefill(_request(), metadata=keyed(), timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "calls are open" in err.details(), err.details()
        # the caller hangs up; the scheduler, still in the step, holds the call until it drops it:
        # the queue is full although only one call is open
        second.cancel()
        wait_for("the second call closed", lambda: service.open_calls == 1)
        err = _refused(lambda: stub.Prefill(_request(), metadata=keyed(), timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queued" in err.details(), err.details()
        latch.set()
        assert _complete(first).prompt_len == len(PROMPT)
    finally:
        latch.set()
    wait_for("the scheduler drained", lambda: not service.scheduler.pending and service.open_calls == 0)


def test_a_call_whose_grammar_compiles_counts_as_open(pair, stub, serves_exactly):
    """Constrained calls compile before they are queued: they count against --max-open-calls while
    they compile (they did not, so any number could hold compiles at once)."""
    from common.engine.grammar import runner_compiler

    service = pair.prefill
    compiler = runner_compiler(service.runner)
    real = compiler.pool
    compiler.pool = GatedPool(real)
    gate, started = compiler.pool.gate, compiler.pool.started
    calls = []
    try:
        sp = prefill_pb2.SamplingParams(max_new_tokens=2, regex="(held|open)+")
        calls = [stub.Prefill(_request(sampling_params=sp), metadata=keyed(), timeout=60) for _ in range(2)]
        assert started.wait(20), "no compile started"
        wait_for("two compiling calls open", lambda: service.open_calls == 2)
        err = _refused(lambda: stub.Prefill(_request(), metadata=keyed(), timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "calls are open" in err.details(), err.details()
    finally:
        gate.set()
        compiler.pool = real
    for call in calls:
        assert _complete(call).prompt_len == len(PROMPT)
    wait_for("no call open", lambda: service.open_calls == 0)


def test_an_unauthenticated_large_body_is_refused(stub, serves_exactly):
    big = prefill_pb2.PrefillRequest(request_id="x" * (32 << 20), input_ids=PROMPT)
    err = _refused(lambda: stub.Prefill(big, timeout=60))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()


def test_an_unauthenticated_body_is_never_parsed():
    """The key is judged on the call's metadata before its body is read: the method's parser never
    runs for a refused call (it ran, on up to 64 MiB, before the refusal was answered)."""
    parsed = []

    def parse(data: bytes) -> prefill_pb2.PrefillRequest:
        parsed.append(len(data))
        return prefill_pb2.PrefillRequest.FromString(data)

    async def prefill(request, context):
        yield prefill_pb2.PrefillChunk(first_token=prefill_pb2.FirstToken(token_id=len(request.input_ids)))

    server = AioServer("127.0.0.1", 0, [], interceptors=security.interceptors(KEY, signed=True))
    handler = grpc.unary_stream_rpc_method_handler(
        prefill, request_deserializer=parse, response_serializer=prefill_pb2.PrefillChunk.SerializeToString
    )
    server.server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("disagg.v1.Prefill", {"Prefill": handler}),)
    )
    server.start()
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)])
    try:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        big = prefill_pb2.PrefillRequest(request_id="x" * (32 << 20), input_ids=PROMPT)
        for _ in range(2):
            err = _refused(lambda: stub.Prefill(big, timeout=60))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
        assert parsed == []
        replies = list(stub.Prefill(_request(), metadata=keyed(), timeout=30))
        assert [r.first_token.token_id for r in replies] == [len(PROMPT)] and len(parsed) == 1
    finally:
        channel.close()
        server.stop(0)


def test_the_sweep_skips_a_fifo_named_like_a_pool_file(tmp_path):
    fifo = tmp_path / f"{shm_files.PREFIX}1-abc"
    os.mkfifo(fifo, 0o600)
    stale = tmp_path / f"{shm_files.PREFIX}2-def"  # left by a crash: nobody holds it
    stale.write_bytes(b"\0" * 64)
    swept: list = []
    sweeper = threading.Thread(target=lambda: swept.append(shm_files.sweep(str(tmp_path))), daemon=True)
    sweeper.start()
    sweeper.join(30)
    if sweeper.is_alive():  # blocked opening the FIFO: a writer releases it, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        sweeper.join(5)
        pytest.fail("the sweep blocked on a FIFO named like a pool file")
    assert swept == [[str(stale)]] and fifo.exists()
