"""The decode front door under pressure: every bad input named, control RPCs answering with 200
streams open, fast failure with no prefill replica, UNIMPLEMENTED without a traceback."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.wire.grpc_server import channel_options
from prefill_service.config import PrefillConfig
from prefill_service.hooks import Delays
from prefill_service.server import PrefillService
from tests.grpc_harness import GrpcPair, held_worker
from tests.oracle import hf_greedy

OK_PROMPT = [5, 6, 7, 8]


def _req(**over) -> pb.GenerateRequest:
    r = pb.GenerateRequest(
        request_id="bad",
        tokenized=pb.TokenizedInput(input_ids=OK_PROMPT),
        sampling_params=pb.SamplingParams(max_new_tokens=4),
    )
    for path, value in over.items():
        target, name = (r.sampling_params, path[3:]) if path.startswith("sp_") else (r, path)
        if name == "input_ids":
            del r.tokenized.input_ids[:]
            r.tokenized.input_ids.extend(value)
        elif name in ("logprob_start_len", "top_logprobs_num", "token_ids_logprob"):  # asked with return_logprob
            r.return_logprob = True
            getattr(target, name).extend(value) if isinstance(value, list) else setattr(target, name, value)
        elif isinstance(value, list):
            getattr(target, name).extend(value)
        elif name == "logit_bias":
            target.logit_bias["5"] = value
        elif name in ("custom_params", "disaggregated_params", "mm_inputs"):
            getattr(target, name).SetInParent()
        else:
            setattr(target, name, value)
    return r


BAD = [  # (field set, value, words the message must contain)
    ("sp_temperature", float("nan"), "temperature"),
    ("sp_temperature", math.inf, "temperature"),
    ("sp_temperature", -0.5, "temperature"),
    ("sp_top_p", 1.5, "top_p"),
    ("sp_top_p", -0.1, "top_p"),
    ("sp_top_k", -2, "top_k"),
    ("sp_min_p", 1.5, "min_p"),
    ("sp_min_p", -0.1, "min_p"),
    ("sp_max_new_tokens", 0, "max_new_tokens"),
    ("sp_max_new_tokens", 10**6, "context length"),
    ("input_ids", [], "empty prompt"),
    ("input_ids", [5, 10**7], "vocabulary"),
    ("sp_n", 129, "n must be in [1, 128]"),
    ("sp_stop", [""], "stop"),
    ("sp_stop_token_ids", [10**7], "stop_token_ids"),
    ("sp_regex", "(a+", "regex"),  # constraints that do not compile (tests/test_grammar.py: ones that do)
    ("sp_json_schema", "{not json", "json_schema"),
    ("sp_ebnf_grammar", "x", "ebnf_grammar"),
    ("sp_frequency_penalty", 2.5, "frequency_penalty"),
    ("sp_presence_penalty", -2.5, "presence_penalty"),
    ("sp_repetition_penalty", 2.5, "repetition_penalty"),
    ("sp_min_new_tokens", 5, "min_new_tokens (5) exceeds max_new_tokens (4)"),
    ("sp_logit_bias", 150.0, "logit_bias"),
    ("sp_custom_params", None, "custom_params"),
    ("sp_stream_interval", 4, "stream_interval"),
    ("logprob_start_len", len(OK_PROMPT), "logprob_start_len"),  # prompt logprobs from beyond the prompt
    ("logprob_start_len", -2, "logprob_start_len"),
    ("top_logprobs_num", 21, "top_logprobs_num"),
    ("token_ids_logprob", [10**7], "token_ids_logprob"),
    ("return_hidden_states", True, "return_hidden_states"),
    ("mm_inputs", None, "mm_inputs"),
    ("lora_id", "adapter", "lora_id"),
    ("custom_logit_processor", "proc", "custom_logit_processor"),
    ("input_embeds", [0.5, 0.5], "input_embeds"),
    ("disaggregated_params", None, "disaggregated_params"),
    ("data_parallel_rank", 7, "data_parallel_rank"),
]


@pytest.fixture(scope="module")
def pair(checkpoint):
    p = GrpcPair(checkpoint("llama"), decode_kw=dict(max_running_requests=8, max_queued_requests=256))
    yield p
    p.close()


def test_every_bad_input_is_named_then_a_good_request_works(pair, checkpoint):
    for field, value, words in BAD:
        with pytest.raises(grpc.RpcError) as err:
            list(pair.stub.Generate(_req(**{field: value})))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value)
        assert words in err.value.details(), (field, err.value.details())
    # an Abort that names no request, and a request id already in flight
    with pytest.raises(grpc.RpcError) as err:
        pair.stub.Abort(pb.AbortRequest(request_id=""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    first = pair.generate(OK_PROMPT, 400, stream=True, rid="twin", ignore_eos=True)
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        list(pair.generate(OK_PROMPT, 4, rid="twin"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in err.value.details()
    assert pair.stub.Abort(pb.AbortRequest(request_id="twin")).success
    assert pair.collect(first)[1].finish_reason == "abort"
    # a message over the 64 MiB limit is refused by gRPC itself, before the handler
    with pytest.raises(grpc.RpcError) as err:
        list(pair.stub.Generate(_req(custom_logit_processor="x" * (65 << 20))))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # fields that only shape text, and data_parallel_rank 0, are accepted
    ok = _req(data_parallel_rank=0, sp_skip_special_tokens=True, sp_stream_interval=1, logprob_start_len=-1)
    ids, complete = pair.collect(pair.stub.Generate(ok))
    assert ids == hf_greedy(checkpoint("llama"), OK_PROMPT, 4)
    pair.wait_idle()


def test_the_receive_limit_follows_the_context_and_long_prompts_are_refused_before_a_scan(pair):
    """A message past what a request within the model's context can take (5 bytes an id, 1 MiB beside)
    is refused by gRPC before any parsing (a 57 MiB one held the event loop 5.5 s under the 64 MiB limit);
    a prompt as long as the context is refused by its length, named, before its ids are copied."""
    from common.request_rules import MAX_REQUEST_OVERHEAD_BYTES, max_request_bytes

    context = pair.decode.runner.context_length
    bound = max_request_bytes(context)
    assert bound == 5 * context + MAX_REQUEST_OVERHEAD_BYTES < 64 << 20
    with pytest.raises(grpc.RpcError) as err:
        list(pair.stub.Generate(_req(input_ids=[7] * (bound + 1), sp_max_new_tokens=1)))  # one byte an id
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    with pytest.raises(grpc.RpcError) as err:
        list(pair.stub.Generate(_req(input_ids=[10**6] * context)))  # out of vocabulary too: the length decides
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"({context} tokens) exceeds the context length {context}" in err.value.details()
    ids, _ = pair.collect(pair.stub.Generate(_req()))  # and the door still serves
    assert len(ids) == 4


def test_unimplemented_rpcs_answer_cleanly(pair, caplog):
    caplog.set_level(logging.DEBUG)
    channel = pair.channel
    call = channel.unary_stream("/sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents")
    with pytest.raises(grpc.RpcError) as err:
        list(call(b""))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    flush = channel.unary_unary("/sglang.grpc.scheduler.SglangScheduler/FlushCache")
    with pytest.raises(grpc.RpcError) as err:
        flush(b"")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_control_rpcs_answer_with_200_streams_open(checkpoint):
    # prefill's step is latched so all 200 calls stay open until the test lets them go (8 awaiting
    # handoffs, the rest queued): a control RPC that answers at all answered with every stream held
    pair = GrpcPair(
        checkpoint("llama"),
        prefill_kw=dict(max_chunk_bytes=512),
        decode_kw=dict(max_running_requests=8, max_queued_requests=192),
    )
    in_step, latch = held_worker(pair.prefill)
    calls = []
    try:
        calls = [pair.generate([5 + i % 50, 6, 7], 8, stream=True, rid=f"open{i}", ignore_eos=True) for i in range(200)]
        deadline = time.time() + 20
        while pair.decode._open < 200:
            assert time.time() < deadline, f"only {pair.decode._open} calls open"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as err:  # over the bound
            list(pair.generate([5, 6], 2, rid="one-too-many"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        health = health_pb2_grpc.HealthStub(pair.channel)
        t = 30  # a timeout only against a hang: held streams never let a queued RPC through
        rpcs = {
            "HealthCheck": lambda: pair.stub.HealthCheck(pb.HealthCheckRequest(), timeout=t).healthy,
            "health.Check": lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=t).status == 1,
            "GetLoads": lambda: pair.stub.GetLoads(pb.GetLoadsRequest(), timeout=t).loads[0].num_waiting_reqs > 100,
            "Abort": lambda: pair.stub.Abort(pb.AbortRequest(request_id="open199"), timeout=t).success,
        }
        assert in_step.wait(20), "prefill never began a step"
        for name, rpc in rpcs.items():  # no clock bound: each answers before any stream can end
            assert rpc(), name
            assert pair.decode._open >= 199 and not latch.is_set(), f"{name} answered only after streams ended"
        assert sum(c.done() for c in calls) <= 1, "a stream ended while the prefill was held"  # open199: aborted
        probe = subprocess.run(
            [sys.executable, "-m", "common.tools.health_probe", pair.decode.address], capture_output=True, timeout=30
        )
        assert probe.returncode == 0, probe.stderr
    finally:
        latch.set()
        for c in calls:
            c.cancel()
        pair.close()  # waits for idle and checks both pools balance


def test_no_prefill_replica_fails_fast_and_a_restart_serves_within_seconds(checkpoint):
    path = checkpoint("llama")
    pair = GrpcPair(path)
    port = int(pair.prefill.address.rsplit(":", 1)[1])
    try:
        pair.prefill.stop()
        deadline = time.time() + 5
        while pair.stub.HealthCheck(pb.HealthCheckRequest()).healthy:
            assert time.time() < deadline
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as err:
            list(pair.generate(OK_PROMPT, 4))
        # fast: refused at admission, not admitted to wait prefill_wait_s for a replica (that one ends
        # in "no prefill replica left: none serving within ...")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert err.value.details() == "no prefill replica is serving", err.value.details()
        assert pair.decode.runner.kv_allocator.num_used == 0  # nothing was reserved
        pair.prefill = PrefillService(PrefillConfig(path, port=port, debug_checks=True)).start()
        # 23.3: a call sent as soon as the replica serves, before decode's cached health knows, is
        # served (it failed at once with UNAVAILABLE while decode's channel waited out its backoff)
        assert pair.collect(pair.generate(OK_PROMPT, 4))[0] == hf_greedy(path, OK_PROMPT, 4)
        # decode's channels to replicas retry within 1 s (channel_options), not gRPC's default of up to
        # 120 s; the health watcher looks every 0.25 s. 15 s leaves a busy CI room.
        options = dict(channel_options(keepalive=True))
        assert options["grpc.max_reconnect_backoff_ms"] <= 1_000, options
        serving_at = time.perf_counter()
        while not pair.stub.HealthCheck(pb.HealthCheckRequest()).healthy:
            assert time.perf_counter() - serving_at < 15.0, (
                "restarted replica not reported within 15 s (1 s reconnect backoff + 0.25 s polls; 15 s: a busy CI)"
            )
            time.sleep(0.05)
    finally:
        pair.close()


def test_shutdown_ends_open_streams_with_unavailable_and_frees_everything(checkpoint):
    pair = GrpcPair(checkpoint("llama"), prefill_kw=dict(max_chunk_bytes=256), prefill_hooks=Delays(kv_message_s=0.3))
    try:
        calls = [pair.generate([5 + i, 6, 7, 8], 40, stream=True, rid="", ignore_eos=True) for i in range(3)]
        deadline = time.time() + 10
        while pair.decode._open < 3:
            assert time.time() < deadline
            time.sleep(0.02)
        # nobody finishes within the grace period: each stream ending with UNAVAILABLE (not its 40
        # tokens) shows that shutdown cut them instead of waiting for them
        shutdown = threading.Thread(target=pair.decode.shutdown, args=(0.3,))
        shutdown.start()
        shutdown.join(60)
        assert not shutdown.is_alive(), (
            "shutdown still running after 60 s (0.3 s grace + up to 2 s for the aborts + 1 s to stop; 60 s: busy CI)"
        )
        for c in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(c)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        sched = pair.decode.scheduler
        assert sched.worker.kv_allocator.num_used == 0 and sched.worker.req_to_token_pool.allocator.num_used == 0
    finally:
        pair.channel.close()
        pair.prefill.stop()


def test_requests_that_can_never_fit_are_refused_not_queued_or_retried(checkpoint):
    """23.1: prompt + max_new_tokens over decode's pool is INVALID_ARGUMENT before anything is
    reserved (it used to wait forever, with every request behind it); a request without
    max_new_tokens gets the default clamped to the pool. 23.2: a prompt over a prefill replica's pool
    is refused by the replica and passed through as INVALID_ARGUMENT (it was retried on every replica
    and ended UNAVAILABLE)."""
    path = checkpoint("llama")
    pair = GrpcPair(path, prefill_kw=dict(max_total_tokens=32), decode_kw=dict(max_total_tokens=64))
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(pair.generate(list(range(5, 15)), 100))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-total-tokens 64" in err.value.details()
        pair.wait_idle()  # nothing was reserved (the pool's books are checked there)
        ids, complete = pair.collect(pair.generate(list(range(5, 15)), None, ignore_eos=True))
        assert complete.finish_reason == "length" and len(ids) == 64 - 10  # the default, clamped to the pool
        with pytest.raises(grpc.RpcError) as err:
            list(pair.generate(list(range(5, 45)), 4))  # 40 prompt tokens: over the prefill pool's 32
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "refused" in err.value.details()
        assert pair.decode.prefill.retries == 0
        ids, _ = pair.collect(pair.generate([5, 6, 7], 4, ignore_eos=True))  # the queue still moves
        assert ids == hf_greedy(path, [5, 6, 7], 4)
        pair.wait_idle()
    finally:
        pair.close()
