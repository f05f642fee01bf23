"""Service surface: checked-in stubs, health, reflection, model info, broken handoffs over gRPC."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.models.config import load_model_config
from decode_service.config import DecodeConfig
from decode_service.server import DecodeService
from prefill_service.hooks import Delays
from tests.grpc_harness import GrpcPair, held_worker, wait_for

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_checked_in_stubs_are_fresh():
    proc = subprocess.run([sys.executable, "proto/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _services(address: str) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(address))
    [reply] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    return {s.name for s in reply.list_services_response.service}


def _health(address: str, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def test_health_reflection_and_model_info(checkpoint):
    path = checkpoint("qwen3")
    pair = GrpcPair(path, decode_kw=dict(served_model_name="tiny-qwen3"))
    try:
        assert "disagg.v1.Prefill" in _services(pair.prefill.address)
        assert "sglang.grpc.scheduler.SglangScheduler" in _services(pair.decode.address)
        assert _health(pair.prefill.address) == health_pb2.HealthCheckResponse.SERVING
        assert (
            _health(pair.decode.address, "sglang.grpc.scheduler.SglangScheduler")
            == health_pb2.HealthCheckResponse.SERVING
        )
        info = pair.stub.GetModelInfo(pb.GetModelInfoRequest())
        cfg = load_model_config(path)
        assert info.served_model_name == "tiny-qwen3" and info.is_generation
        assert info.max_context_length == cfg.context_length and info.vocab_size == cfg.vocab_size
        assert list(info.eos_token_ids) == list(cfg.eos_token_ids) and info.tokenizer_path == cfg.path
        with pytest.raises(grpc.RpcError) as err:  # other runtimes' health checks stay unimplemented
            pair.channel.unary_unary("/vllm.grpc.engine.VllmEngine/HealthCheck")(b"", timeout=2)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        pair.close()


def test_decode_is_unhealthy_without_a_prefill_peer_and_says_unavailable(checkpoint):
    path = checkpoint("qwen2")
    decode = DecodeService(DecodeConfig(path, prefill_addr="127.0.0.1:1", port=0, prefill_wait_s=0.5)).start()
    try:
        wait_for(
            "grpc.health.v1 never said NOT_SERVING",
            lambda: _health(decode.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        # HealthCheck answers from the cached state: asked while a probe of the replicas hangs (a replica
        # slow to answer), it still answers before the probe is let go (no clock bound needed)
        probing, release, any_serving = threading.Event(), threading.Event(), decode.prefill.any_serving

        def hanging_probe(fresh=False):
            probing.set()
            release.wait(60)
            return any_serving(fresh)

        decode.prefill.any_serving = hanging_probe
        try:
            assert probing.wait(20), "the health watcher never probed the replicas"
            stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
            reply = stub.HealthCheck(pb.HealthCheckRequest(), timeout=30)  # a timeout only against a hang
            assert not release.is_set()  # answered while the probe hung
        finally:
            decode.prefill.any_serving = any_serving
            release.set()
        assert not reply.healthy and "prefill" in reply.message
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.Generate(
                    pb.GenerateRequest(
                        request_id="x",
                        tokenized=pb.TokenizedInput(input_ids=[5, 6]),
                        sampling_params=pb.SamplingParams(max_new_tokens=4),
                    )
                )
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no prefill replica" in err.value.details()
        deadline = time.time() + 10
        while not decode.scheduler.idle:  # the failure is reported before the scheduler thread moves on
            assert time.time() < deadline
            time.sleep(0.01)
        decode.scheduler.check_integrity()
        assert decode.runner.kv_allocator.num_used == 0
    finally:
        decode.stop()


def test_prefill_killed_mid_handoff_fails_the_request_cleanly(checkpoint):
    pair = GrpcPair(checkpoint("llama"), prefill_kw=dict(max_chunk_bytes=512), prefill_hooks=Delays(kv_message_s=0.05))
    try:
        call = pair.generate(list(range(5, 35)), 8, stream=True, ignore_eos=True)
        first = next(call)  # the first token arrived; KV chunks still coming
        assert first.chunk.token_ids
        pair.prefill.server.stop(0)  # the prefill replica dies mid-handoff
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "prefill" in err.value.details()
        pair.wait_idle()
    finally:
        pair.close()


def test_a_broken_scheduler_fails_calls_with_internal_and_reports_unhealthy(checkpoint):
    pair = GrpcPair(checkpoint("qwen2"))
    sched = pair.decode.scheduler

    forward = sched.worker.forward

    def explode(batch):  # a patched worker: its third forward fails
        if batch.step == 3:
            raise RuntimeError("device lost")
        return forward(batch)

    sched.worker.forward = explode
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(pair.generate([5, 6, 7], 20, stream=True, ignore_eos=True))
        assert err.value.code() == grpc.StatusCode.INTERNAL and "device lost" in err.value.details()
        assert not pair.stub.HealthCheck(pb.HealthCheckRequest()).healthy
        with pytest.raises(grpc.RpcError) as err:  # later calls are refused, not left hanging
            list(pair.generate([5, 6], 4))
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
    finally:
        pair.channel.close()
        pair.decode.stop()
        pair.prefill.stop()


def test_a_call_whose_scheduler_died_without_a_record_for_it_ends_with_internal(checkpoint):
    """The scheduler never answers the call (its submit swallowed here), then dies: the call ends with INTERNAL
    within about a second (one watch for every open call), not left open."""
    pair = GrpcPair(checkpoint("qwen2"))
    sched = pair.decode.scheduler
    sched.submit_checked = lambda *args, **kwargs: None  # no record will ever come for the call
    request = pb.GenerateRequest(
        request_id="r", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]), stream=True,
        sampling_params=pb.SamplingParams(max_new_tokens=4),
    )  # fmt: skip
    call = pair.stub.Generate(request, timeout=30)  # left open, it would end DEADLINE_EXCEEDED, not INTERNAL
    try:
        wait_for("the call never opened", lambda: pair.decode._open == 1)
        time.sleep(1.5)  # a quiet while, the scheduler alive: the call stays open
        assert pair.decode._open == 1
        died = time.monotonic()
        sched.fatal_error = RuntimeError("gone")
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "gone" in err.value.details()
        assert time.monotonic() - died < 10.0  # a watch once a second (bounds a hang, not a speed)
    finally:
        call.cancel()
        pair.channel.close()
        pair.decode.stop()


def test_prefill_call_cancelled_while_queued_releases_its_handler(checkpoint):
    """A cancel the server has seen before the call is admitted prevents its prefill, and the call's
    handler returns. (The cancel travels to the server asynchronously: a cancel still in flight when
    the scheduler admits the call cannot prevent it, so the test waits until the server has seen it.)"""

    from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
    from prefill_service.config import PrefillConfig
    from prefill_service.server import PrefillService

    service = PrefillService(PrefillConfig(checkpoint("qwen2"), port=0)).start()
    sched = service.scheduler
    in_step, latch = held_worker(service)
    try:
        stub = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(service.address))
        busy = stub.Prefill(prefill_pb2.PrefillRequest(request_id="a", input_ids=[5, 6, 7]))
        assert in_step.wait(5), "call a never reached the worker"  # "a" holds the scheduler in its step
        queued = stub.Prefill(prefill_pb2.PrefillRequest(request_id="b", input_ids=[8, 9]))
        wait_for("call b never reached the scheduler's inbox", lambda: len(sched.inbox) == 1)
        [b] = list(sched.inbox)
        queued.cancel()
        wait_for("the server never saw b's cancel", b.cancelled.is_set)
        latch.set()
        assert [m.WhichOneof("payload") for m in busy][-1] == "record"
        wait_for("the cancelled call's handler never returned", lambda: service.open_calls == 0)
        # the loop drops a cancelled call at its next look (scheduler.py: `pending` keeps it until then)
        wait_for("a call was left without an answer", lambda: not sched.pending)
        assert service.num_prefilled == 1
    finally:
        latch.set()
        service.stop()


def test_prefill_call_cancelled_between_the_schedulers_looks_still_gets_one_answer(checkpoint):
    """A call whose cancel lands while the scheduler sorts its batch is answered exactly once
    (regression: it was neither failed nor prefilled, and its handler blocked forever)."""
    import threading

    from common.engine.handoff import HandoffRequest
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.engine.sampling import SamplingParams
    from prefill_service.scheduler import PrefillCall, PrefillScheduler
    from prefill_service.worker import PrefillWorker

    class CancelledAfterFirstLook:
        def __init__(self):
            self.looks = 0

        def is_set(self) -> bool:
            self.looks += 1
            return self.looks > 1

    worker = PrefillWorker(ModelRunner(RunnerArgs(checkpoint("qwen2"))))
    sched = PrefillScheduler(worker, max_running_requests=16, debug_checks=True)
    answers, answered = [], threading.Event()
    call = PrefillCall(
        HandoffRequest("r", [5, 6, 7], SamplingParams(max_new_tokens=1), seed=1),
        lambda a: (answers.append(a), answered.set()),
    )
    call.cancelled = CancelledAfterFirstLook()
    sched.start()
    try:
        sched.submit(call)
        assert answered.wait(10), "the call got no answer: its handler would wait forever"
    finally:
        sched.stop()
    assert len(answers) == 1, f"answered {len(answers)} times"
    assert getattr(answers[0], "first_token", None) is not None or isinstance(answers[0], Exception)
    worker.check_idle_integrity()


def test_malformed_request_bytes_get_invalid_argument_on_both_services(checkpoint, caplog):
    """23.6: bytes that are not the request message were an INTERNAL error with a traceback."""
    pair = GrpcPair(checkpoint("qwen2"))
    garbage = b"\xff\xff\xff\xff\x0f"
    try:
        calls = [
            (pair.decode.address, "/sglang.grpc.scheduler.SglangScheduler/Generate", "unary_stream"),
            (pair.decode.address, "/sglang.grpc.scheduler.SglangScheduler/HealthCheck", "unary_unary"),
            (pair.prefill.address, "/disagg.v1.Prefill/Prefill", "unary_stream"),
        ]
        for address, method, kind in calls:
            channel = grpc.insecure_channel(address)
            with pytest.raises(grpc.RpcError) as err:
                reply = getattr(channel, kind)(method)(garbage, timeout=5)
                if kind == "unary_stream":
                    list(reply)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value)
            assert "malformed" in err.value.details()
        assert "Traceback" not in caplog.text
        assert pair.collect(pair.generate([5, 6, 7], 3))[0]  # both services still serve
    finally:
        pair.close()
