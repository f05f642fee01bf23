"""The prefill server is grpc.aio: open Prefill calls hold no thread, so health and GetLoad answer at
once however many calls wait; a dead scheduler answers every call and turns health NOT_SERVING."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from prefill_service.config import PrefillConfig
from prefill_service.server import PrefillService
from tests.grpc_harness import held_worker, wait_for

HELD = 80  # open calls held at once: more than the 64 handler threads of the old sync server
CANCELLED = 8  # of them cancelled while queued
# No clock bound on health and GetLoad: every call is held (the latched step or the queue) until the
# test releases it, so an answer at all shows they do not wait behind the calls (the old sync server's
# 64 threads would all be taken); this timeout only keeps a server that regressed from hanging the test.
ANSWER_TIMEOUT_S = 30


def test_many_open_prefill_calls_leave_health_and_getload_answering(checkpoint):
    service = PrefillService(PrefillConfig(checkpoint("qwen2"), port=0, debug_checks=True)).start()
    sched = service.scheduler
    in_step, latch = held_worker(service)
    channel = grpc.insecure_channel(service.address)
    try:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        calls = {
            f"r{i}": stub.Prefill(
                prefill_pb2.PrefillRequest(request_id=f"r{i}", input_ids=[5 + i % 50, 6, 7]), timeout=120
            )
            for i in range(HELD)
        }
        wait_for(
            f"the server never held all {HELD} calls",
            lambda: sched.num_running + sched.num_queued() == HELD and service.open_calls == HELD,
        )
        running = sched.num_running  # the calls in the latched step (those that arrived before it began)
        assert in_step.is_set() and 1 <= running <= service.config.max_running_requests
        assert len(sched.inbox) >= CANCELLED

        for _ in range(3):
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_TIMEOUT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            load = stub.GetLoad(prefill_pb2.LoadRequest(), timeout=ANSWER_TIMEOUT_S)
            assert (load.num_running_reqs, load.num_waiting_reqs) == (running, HELD - running)
            assert service.open_calls == HELD and not latch.is_set(), "answered only once the calls were let go"

        queued = [c for c in sched.inbox][:CANCELLED]  # the loop is in its step: the inbox holds still
        for c in queued:
            calls[c.request.rid].cancel()
        wait_for("the server never saw the cancels", lambda: all(c.cancelled.is_set() for c in queued))
        latch.set()

        cancelled = {c.request.rid for c in queued}
        for rid, call in calls.items():
            if rid in cancelled:
                with pytest.raises(grpc.RpcError) as err:
                    list(call)
                assert err.value.code() == grpc.StatusCode.CANCELLED
            else:
                kinds = [m.WhichOneof("payload") for m in call]
                assert kinds[0] == "first_token" and kinds[-1] == "record" and "kv" in kinds, (rid, kinds)
        wait_for("a Prefill handler never returned", lambda: service.open_calls == 0)
        wait_for("the scheduler never went idle", lambda: sched.num_running == 0 and sched.num_queued() == 0)
        assert not sched.pending, "a call was left without an answer"
        assert service.num_prefilled == HELD - CANCELLED  # a cancel seen while queued prevents the prefill
        assert service.worker.request_kv_used == 0
        assert service.runner.req_to_token_pool.allocator.num_used == 0
        assert sched.alive
    finally:
        latch.set()
        channel.close()
        service.stop()


def test_a_dead_scheduler_answers_every_call_and_reports_not_serving(checkpoint):
    """Regression: an exception escaping the scheduler loop (here from admission) ended its thread
    silently; the calls it held waited forever and health stayed SERVING."""
    service = PrefillService(PrefillConfig(checkpoint("qwen2"), port=0)).start()
    sched = service.scheduler
    in_step, latch = held_worker(service)
    channel = grpc.insecure_channel(service.address)
    try:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        first = stub.Prefill(prefill_pb2.PrefillRequest(request_id="a", input_ids=[5, 6, 7]), timeout=20)
        assert in_step.wait(10), "call a never reached the worker"
        behind = [
            stub.Prefill(prefill_pb2.PrefillRequest(request_id=f"b{i}", input_ids=[8, 9, i + 10]), timeout=20)
            for i in range(4)
        ]
        wait_for("the calls behind a never reached the scheduler", lambda: len(sched.inbox) == 4)

        def broken(request):
            raise RuntimeError("admission bookkeeping broke")

        service.worker.can_admit = broken  # the next admission, after a's step, raises outside the step's try
        latch.set()

        assert [m.WhichOneof("payload") for m in first][-1] == "record"  # a's step had finished
        for call in behind:
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.INTERNAL, err.value
            assert "admission bookkeeping broke" in err.value.details()
        assert not sched.alive and not sched.pending
        wait_for(
            "health never turned NOT_SERVING",
            lambda: (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            ),
        )
        with pytest.raises(grpc.RpcError) as err:  # later calls are refused at once, not left hanging
            list(stub.Prefill(prefill_pb2.PrefillRequest(request_id="late", input_ids=[5, 6]), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert service.worker.request_kv_used == 0
        assert service.runner.req_to_token_pool.allocator.num_used == 0
    finally:
        latch.set()
        channel.close()
        service.stop()


def test_the_first_token_is_sent_before_the_kv_is_copied_out(checkpoint):
    """docs/architecture.md section 2, step 6: the first token goes out as soon as it is sampled; the KV copy-out
    (and with EAGLE the draft extend) follows. It used to wait for the whole copy-out."""
    service = PrefillService(PrefillConfig(checkpoint("qwen2"), port=0)).start()
    copying, latch, copy_out = threading.Event(), threading.Event(), service.worker._copy_out

    def held_copy_out(done):
        copying.set()
        assert latch.wait(30), "the test never released the copy-out"
        return copy_out(done)

    service.worker._copy_out = held_copy_out
    try:
        stub = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(service.address))
        call = stub.Prefill(prefill_pb2.PrefillRequest(request_id="f", input_ids=[5, 6, 7, 8]), timeout=30)
        first = next(call)  # arrives while the copy-out is held
        # the copy-out starts right after the token is handed over, and may lag the client's read on a
        # busy machine: wait for it (bounded); it stays held, so the token came first
        assert first.WhichOneof("payload") == "first_token" and copying.wait(30) and not latch.is_set()
        latch.set()
        rest = [m.WhichOneof("payload") for m in call]
        assert rest[-1] == "record" and "first_token" not in rest
    finally:
        latch.set()
        service.stop()
