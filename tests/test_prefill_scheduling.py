"""Prefill scheduling across requests: a long prompt does not hold back short ones, results stay
exact, and every slot comes back."""

from __future__ import annotations

import threading
import time

import grpc

from common.engine.handoff import HandoffRequest
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from prefill_service.config import PrefillConfig
from prefill_service.hooks import Delays
from prefill_service.scheduler import PrefillCall, PrefillScheduler
from prefill_service.server import PrefillService
from prefill_service.worker import PrefillWorker
from tests.oracle import hf_greedy

GREEDY = SamplingParams(max_new_tokens=1)


def _req(rid, n, base=5):
    return HandoffRequest(rid, [base + i % 300 for i in range(n)], GREEDY, seed=1)


def test_budget_policy_short_prompts_first_oldest_never_starves(checkpoint):
    worker = PrefillWorker(ModelRunner(RunnerArgs(checkpoint("llama"))), chunk_size=64)
    long, short = _req("long", 400), [_req(f"s{i}", 10 + i) for i in range(3)]
    for r in (long, *short):
        worker.admit(r)
    plan = {w.request.rid: n for w, n in worker.plan()}
    assert plan == {"long": 64 - 10 - 11 - 12, "s0": 10, "s1": 11, "s2": 12}
    done = [r.rid for r, _ in worker.step()]
    assert done == ["s0", "s1", "s2"]  # every short prompt finished in the first step
    many = [_req(f"m{i}", 30) for i in range(4)]  # more short work than the budget
    for r in many:
        worker.admit(r)
    plan = {w.request.rid: n for w, n in worker.plan()}
    assert plan["long"] == 16 and sum(plan.values()) == 64  # a quarter of the budget for the oldest
    while worker.running:
        worker.step()
    worker.check_idle_integrity()


def test_worker_results_match_the_oracle_when_requests_interleave(checkpoint):
    path = checkpoint("llama")
    worker = PrefillWorker(ModelRunner(RunnerArgs(path)), chunk_size=32)
    reqs = [_req("a", 150), _req("b", 7, base=40), _req("c", 60, base=90), _req("d", 3, base=200)]
    handoffs = worker.prefill(reqs)
    for r, h in zip(reqs, handoffs):
        assert h.rid == r.rid and h.first_token == hf_greedy(path, r.prompt_ids, 1)[0]
    assert worker.request_kv_used == 0


def test_short_prompt_first_token_arrives_before_a_long_prefill_ends(checkpoint):
    config = PrefillConfig(checkpoint("llama"), port=0, chunked_prefill_size=32, debug_checks=True)
    service = PrefillService(config, hooks=Delays(step_s=0.05)).start()
    try:
        stub = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(service.address))
        first_at: dict[str, float] = {}

        def run(rid, ids):
            for msg in stub.Prefill(prefill_pb2.PrefillRequest(request_id=rid, input_ids=ids), timeout=60):
                if msg.WhichOneof("payload") == "first_token":
                    first_at[rid] = time.perf_counter()

        long = threading.Thread(target=run, args=("long", [5 + i % 300 for i in range(480)]))
        long.start()  # 480 tokens at most 32 per 50 ms step: well over 0.75 s of prefill
        deadline = time.time() + 10
        while service.num_running == 0:
            assert time.time() < deadline
            time.sleep(0.01)
        shorts = [threading.Thread(target=run, args=(f"short{i}", [7 + i, 8, 9, 10])) for i in range(3)]
        for t in shorts:
            t.start()
        for t in (long, *shorts):
            t.join(60)
        assert len(first_at) == 4
        assert max(first_at[f"short{i}"] for i in range(3)) < first_at["long"], first_at
    finally:
        service.stop()
    assert service.worker.request_kv_used == 0


def test_a_failing_step_answers_every_admitted_call_once(checkpoint):
    service = PrefillService(PrefillConfig(checkpoint("llama"), port=0, debug_checks=True)).start()
    sched = service.scheduler
    real = service.worker._to_handoff
    calls = {"n": 0}

    def second_breaks(w, k, v):  # the step completes two prompts; building the second handoff fails
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("copy-out failed")
        return real(w, k, v)

    service.worker._to_handoff = second_breaks
    try:
        stub = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(service.address))
        latch, take = threading.Event(), sched.process_input_requests
        sched.process_input_requests = lambda: (latch.wait(10), take())[1]  # both prompts land in one step
        results = {}

        def run(rid):
            try:
                results[rid] = [
                    m.WhichOneof("payload")
                    for m in stub.Prefill(prefill_pb2.PrefillRequest(request_id=rid, input_ids=[5, 6, 7]), timeout=20)
                ]
            except grpc.RpcError as e:
                results[rid] = e.code()

        threads = [threading.Thread(target=run, args=(r,)) for r in ("a", "b")]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while len(sched.inbox) < 2:  # the loop woke for "a" and is held before taking it; "b" queued too
            assert time.time() < deadline, "the calls never reached the scheduler"
            time.sleep(0.01)
        latch.set()
        for t in threads:
            t.join(30)
        assert results == {"a": grpc.StatusCode.INTERNAL, "b": grpc.StatusCode.INTERNAL}, results
        assert service.worker.request_kv_used == 0
        assert sched.alive, "a failed step fails its calls, not the scheduler"
    finally:
        service.stop()


class _AdmissionBreaks:
    """The worker surface the scheduler touches, with no model: admission bookkeeping that raises."""

    def validate(self, request):
        pass

    def can_admit(self, request):
        raise RuntimeError("admission bookkeeping broke")

    def fail_all(self):
        return []


def test_an_exception_escaping_the_loop_answers_every_call_and_reports_the_scheduler_dead():
    """Regression: an exception outside the step's own try ended the scheduler thread silently, and
    every call it held (and every later one) waited forever."""
    fatal = []
    sched = PrefillScheduler(_AdmissionBreaks(), max_running_requests=4, on_fatal=fatal.append)
    answers: dict[str, list] = {}
    done = threading.Event()

    def call(rid):
        def on_answer(a):
            answers.setdefault(rid, []).append(a)
            if len(answers) == 4:
                done.set()

        return PrefillCall(_req(rid, 3), on_answer)

    for rid in ("a", "b", "c"):  # queued before the loop starts: all three are in `waiting` when it breaks
        sched.submit(call(rid))
    sched.start()
    try:
        deadline = time.time() + 10
        while sched.alive:
            assert time.time() < deadline, "the scheduler never reported itself dead"
            time.sleep(0.01)
        sched.submit(call("late"))  # after the crash: answered at once, never queued
        assert done.wait(10), f"calls left without an answer: {sorted({'a', 'b', 'c', 'late'} - set(answers))}"
    finally:
        sched.stop()
    assert {rid: len(a) for rid, a in answers.items()} == {"a": 1, "b": 1, "c": 1, "late": 1}
    assert all(
        isinstance(a[0], RuntimeError) and "admission bookkeeping broke" in str(a[0]) for a in answers.values()
    ), answers
    assert [str(e) for e in fatal] == ["admission bookkeeping broke"]
    assert not sched.pending and sched.num_queued() == 0 and sched.num_running == 0
