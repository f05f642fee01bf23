"""One test per FutureMap / ScheduleBatch invariant (docs/architecture.md, "The FutureMap and its invariants")."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from common.engine.sampling import SamplingParams
from common.engine.streams import HostEvent, StreamFailed, WorkerStream
from decode_service.future_map import ConsumeOnceError, FutureMap
from decode_service.schedule_batch import ScheduleBatch
from decode_service.scheduler import InvariantError
from tests.decode_harness import ManualPair, Pair
from tests.oracle import hf_greedy


def _fm(size: int = 8, debug: bool = True) -> FutureMap:
    return FutureMap(size, "cpu", HostEvent, debug=debug)


def _idx(*rows):
    return torch.tensor(rows, dtype=torch.int64)


# Waits below are on explicit signals. GUARD_S only bounds a wait that a correct mechanism ends at once
# (a thread handing over to another): it is reached only when something hangs, which is a failure
# anyway, so it is generous enough for a loaded 2-core CI host and never decides a pass.
GUARD_S = 30.0


class Events:
    """A `make_event` for FutureMap: the CPU path's real events (HostEvent), named step0, step1, ... in
    the order armed, that report to `log` when stream work blocks on one (`wait_here`), when stream work
    sets one (`set_here`, reported before the flag is set, so a thread it wakes reports after it) and
    when a host waiter finds one unset (`synchronize`); every report wakes `progress`."""

    def __init__(self):
        self.log: list[tuple[str, str]] = []
        self.progress = threading.Event()
        self.made = 0

    def __call__(self) -> HostEvent:
        self.made += 1
        return _ReportingEvent(f"step{self.made - 1}", self)

    def report(self, what: str, name: str) -> None:
        self.log.append((what, name))
        self.progress.set()


class _ReportingEvent(HostEvent):
    def __init__(self, name: str, events: Events):
        super().__init__()
        self.name, self.events = name, events

    def wait_here(self) -> None:
        self.events.report("stream waits on", self.name)
        super().wait_here()

    def set_here(self) -> None:
        self.events.report("set", self.name)
        super().set_here()

    def synchronize(self, timeout: float | None = None) -> None:
        if not self.query():
            self.events.report("host waits on unset", self.name)
        super().synchronize(timeout)


def test_1_rows_are_request_slots(checkpoint):
    fm = _fm(8)
    assert fm.token_ids.shape[0] == fm.kv_committed_lens.shape[0] == 9
    fm.stash_tokens(_idx(3, 1), torch.tensor([30, 10]))
    assert fm.gather_tokens(_idx(1, 3)).tolist() == [10, 30]
    pair = ManualPair(checkpoint("qwen2"), decode_reqs=5)
    assert (
        pair.scheduler.worker.future_map.num_rows
        == pair.scheduler.worker.runner.req_to_token_pool.req_to_token.shape[0]
        == 6
    )
    pair.close()


def test_2_stash_has_no_fence_and_publish_sets_the_armed_event():
    fm, stream = _fm(), WorkerStream()
    fence = fm.arm_publish(stream)
    fm.stash_tokens(_idx(2), torch.tensor([5]))
    assert not fence.query()  # a stash never touches publish_ready
    stream.submit(lambda: fm.publish_kv_committed_lens(_idx(2), torch.tensor([17]), fence))
    fence.synchronize(timeout=5)
    assert fm.resolve_kv_committed_lens_cpu(_idx(2)).tolist() == [17]
    stream.close()


def test_2_the_publish_fence_is_set_after_the_write():
    """A reader woken by publish_ready sees the published value. The fence's event holds the stream
    once it is set until the reader has read (as the draft extend keeps the stream busy after a real
    publish), so a fence set before the write lets the reader in before it, deterministically."""
    read = threading.Event()

    class HoldsUntilRead(HostEvent):  # the CPU worker's real event, with the stream held after its set
        def set_here(self) -> None:
            super().set_here()
            read.wait(GUARD_S)  # released by the reader below; the bound only ends a hang

    fm, stream = FutureMap(8, "cpu", HoldsUntilRead, debug=True), WorkerStream()
    fm.seed_kv_committed_lens(_idx(3), torch.tensor([10]))  # the row's previous length: the stale value
    fence = fm.arm_publish(stream)
    stream.submit(lambda: fm.publish_kv_committed_lens(_idx(3), torch.tensor([17]), fence))
    try:
        seen = fm.resolve_kv_committed_lens_cpu(_idx(3), timeout=GUARD_S)
    finally:
        read.set()
    assert seen.tolist() == [17], (
        f"resolve woken by publish_ready read {seen.tolist()}: the fence came before the write"
    )
    stream.close()


def test_2_publish_from_another_stream_chains_the_previous_fence():
    events = Events()
    fm, a, b = FutureMap(8, "cpu", events, debug=True), WorkerStream("a"), WorkerStream("b")
    latch = threading.Event()
    fence_a = fm.arm_publish(a)  # step0
    a.submit(lambda: latch.wait(GUARD_S))  # step N's publish on stream a is held until b has decided
    a.submit(lambda: fm.publish_kv_committed_lens(_idx(1), torch.tensor([7]), fence_a))
    fence = fm.arm_publish(b)  # step1
    b.submit(lambda: fm.publish_kv_committed_lens(_idx(2), torch.tensor([9]), fence))
    try:
        # b's publish reports when it reaches its fence: chained, it first blocks on a's (unset) step0;
        # unchained, it sets step1 at once. Stream a reports nothing while the latch holds it.
        assert events.progress.wait(GUARD_S), "stream b never reached its fence"
        assert events.log[0] == ("stream waits on", "step0"), f"b's fence did not wait for a's: {events.log}"
        assert not fence.query()
    finally:
        latch.set()
    assert fm.resolve_kv_committed_lens_cpu(_idx(1, 2), timeout=GUARD_S).tolist() == [7, 9]
    stream_side = [e for e in events.log if e[0] != "host waits on unset"]  # the resolve's own waits aside
    assert stream_side == [("stream waits on", "step0"), ("set", "step0"), ("set", "step1")], events.log
    a.close(), b.close()


def test_3_resolve_waits_for_the_armed_step_not_an_older_event():
    events = Events()
    fm, stream = FutureMap(8, "cpu", events, debug=True), WorkerStream()
    first = fm.arm_publish(stream)
    stream.submit(lambda: fm.publish_kv_committed_lens(_idx(4), torch.tensor([10]), first))
    assert fm.resolve_kv_committed_lens_cpu(_idx(4), timeout=GUARD_S).tolist() == [10]
    latch = threading.Event()
    second = fm.arm_publish(stream)  # step N+1 armed at submit, before its forward runs
    stream.submit(lambda: latch.wait(GUARD_S))
    stream.submit(lambda: fm.publish_kv_committed_lens(_idx(4), torch.tensor([11]), second))
    # step N+1's publish is held behind the latch, so it cannot have run: a zero timeout asks without
    # waiting, and must not return step N's (stale) 10
    with pytest.raises(TimeoutError):
        fm.resolve_kv_committed_lens_cpu(_idx(4), timeout=0)
    # a blocking resolve (as the scheduler calls it) must wait on step N+1's unset event: the latch is
    # released only once the reader reports that wait, or has returned (with a stale value)
    events.progress.clear()
    start, got = len(events.log), []

    def reader():
        try:
            got.append(fm.resolve_kv_committed_lens_cpu(_idx(4)).tolist())
        finally:
            events.report("resolve returned", "")

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        assert events.progress.wait(GUARD_S), "resolve neither waited nor returned"
        assert events.log[start] == ("host waits on unset", "step1"), f"resolve did not wait for step N+1: {got}"
    finally:
        latch.set()
    thread.join(GUARD_S)
    assert got == [[11]]
    stream.close()


def test_3_resolve_fails_instead_of_hanging_when_the_stream_failed_before_publish():
    fm, stream = _fm(), WorkerStream()
    fence = fm.arm_publish(stream)

    def broken_forward():
        raise RuntimeError("forward blew up before its publish")

    stream.submit(broken_forward)
    stream.submit(lambda: fm.publish_kv_committed_lens(_idx(4), torch.tensor([10]), fence))  # never runs
    outcome = []

    def resolve():
        try:
            outcome.append(fm.resolve_kv_committed_lens_cpu(_idx(4)))  # no timeout: must still return
        except Exception as e:
            outcome.append(e)

    waiter = threading.Thread(target=resolve, daemon=True)
    waiter.start()
    waiter.join(timeout=5)
    assert not waiter.is_alive(), "resolve_kv_committed_lens_cpu hung on a failed stream"
    assert isinstance(outcome[0], StreamFailed) and "blew up" in str(outcome[0])
    stream.close()


def test_4_bumps_make_new_tensors_and_keep_the_mirror():
    b = ScheduleBatch.empty(torch.device("cpu"))
    b.kv_committed_lens_cpu, b.kv_committed_lens = torch.tensor([3, 5]), torch.tensor([3, 5])
    old, version = b.kv_committed_lens, b.kv_committed_lens._version
    b.bump()
    assert b.kv_committed_lens is not old and old.tolist() == [3, 5] and old._version == version
    b.check_mirror()
    b.kv_committed_lens = b.kv_committed_lens + 1  # a diverged mirror is caught
    with pytest.raises(AssertionError, match="mirror"):
        b.check_mirror()


def test_4_in_place_kv_committed_lens_bump_is_caught(checkpoint, monkeypatch):
    def in_place_bump(self):
        self.kv_committed_lens_cpu = self.kv_committed_lens_cpu + 1
        self.kv_committed_lens.add_(1)  # the forward of this step may still read it

    monkeypatch.setattr(ScheduleBatch, "bump", in_place_bump)
    pair = ManualPair(checkpoint("qwen2"))
    pair.submit("r", [5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True))
    pair.scheduler.step()
    pair.prefill()
    with pytest.raises(InvariantError, match="modified in place"):
        for _ in range(4):
            pair.scheduler.step()
    pair.scheduler.stop()


def test_5_kv_committed_lens_sum_is_derived_from_kv_committed_lens_cpu(checkpoint):
    """After decode step k every running request has committed its prompt and k tokens; the batch's
    kv_committed_lens_sum follows through every bump and every filter (requests finish at different steps),
    checked against that count, not against kv_committed_lens_cpu (the definition)."""
    pair = ManualPair(checkpoint("qwen2"))
    prompts = {str(i): list(range(5, 5 + n)) for i, n in enumerate([3, 7, 2])}
    for i, (rid, prompt) in enumerate(prompts.items()):
        pair.submit(rid, prompt, SamplingParams(max_new_tokens=4 + i, ignore_eos=True))
    pair.scheduler.step()
    pair.prefill()
    sums, members, k = [], [], 0
    while not pair.scheduler.idle:
        pair.scheduler.step()
        k += 1
        batch = pair.scheduler.running_batch
        expected = sum(len(prompts[r.rid]) + k for r in batch.reqs)
        assert batch.kv_committed_lens_sum == expected, (
            k,
            [r.rid for r in batch.reqs],
            batch.kv_committed_lens_sum,
            expected,
        )
        sums.append(batch.kv_committed_lens_sum)
        members.append(len(batch))
    pair.close()
    assert members[0] == 3 and members[-1] == 0 and len(set(members)) == 4, members  # filtered at 3 steps
    assert max(sums) > 0 and sums[-1] == 0


def test_6_consume_once_guard():
    fm = _fm()
    fm.stash_tokens(_idx(1, 2), torch.tensor([4, 5]))
    assert fm.gather_tokens(_idx(1, 2)).tolist() == [4, 5]
    assert fm.token_ids[1].item() == -1  # poisoned after the gather
    with pytest.raises(ConsumeOnceError):  # a second gather without a stash
        fm.gather_tokens(_idx(1))
    fm.stash_tokens(_idx(3), torch.tensor([1]))
    fm.stash_tokens(_idx(3), torch.tensor([2]))
    with pytest.raises(ConsumeOnceError):  # two stashes before one gather
        fm.gather_tokens(_idx(3))
    fm.stash_tokens(_idx(5), torch.tensor([8]))  # a row released with an ungathered stash...
    fm.reset_rows(_idx(5))
    fm.stash_tokens(_idx(5), torch.tensor([9]))  # ...is seeded afresh for its next owner
    assert fm.gather_tokens(_idx(5)).tolist() == [9]
    off = _fm(debug=False)
    off.stash_tokens(_idx(1), torch.tensor([4]))
    assert off.gather_tokens(_idx(1)).tolist() == off.gather_tokens(_idx(1)).tolist() == [4]


def test_6_planted_second_gather_in_the_scheduler_trips(checkpoint):
    from tests.decode_harness import Hooks

    pair = Pair(checkpoint("qwen2"), hooks=Hooks())
    sched = pair.scheduler
    sched.worker.hooks.before_forward = lambda step: (
        step == 3 and sched.worker.future_map.gather_tokens(sched.running_batch.req_pool_indices)
    )
    pair.submit("r", [5, 6, 7], SamplingParams(max_new_tokens=10, ignore_eos=True))
    deadline = time.time() + 20
    while "r" not in pair.out.reasons and time.time() < deadline:
        time.sleep(0.01)
    assert pair.out.reasons["r"] == "error" and not sched.alive
    assert isinstance(sched.fatal_error.__cause__, ConsumeOnceError)
    pair.link.close()


def test_7_slot_reuse_is_ordered_after_the_in_flight_forward(checkpoint):
    """B takes A's row and KV while A's wasted last lane is still in flight: B's writes must wait. A ends
    on a stop token (its sixth), which the scheduler sees only after launching the next step."""
    from tests.decode_harness import Hooks

    path = checkpoint("llama")
    ref = hf_greedy(path, [5, 6, 7], 6)
    assert ref[5] not in ref[:5]  # the sixth token is the first of its kind: it ends A there
    order, latch, threads = [], threading.Event(), {}
    hooks = Hooks()
    pair = ManualPair(path, hooks=hooks, decode_reqs=1, decode_tokens=3 + 8)
    sched = pair.scheduler
    write = sched.worker.runner.req_to_token_pool.write

    def logged_write(idx, start, slots):
        order.append(("row write", idx))
        threads.setdefault("row writes", []).append(threading.current_thread())
        write(idx, start, slots)

    sched.worker.runner.req_to_token_pool.write = logged_write
    pair.submit("A", [5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=(ref[5],)))
    sched.step()
    pair.prefill()

    def before_forward(step):  # step 6 is A's wasted lane, launched before A's stop token is seen
        if step == 6:
            latch.wait(GUARD_S)  # released by the test below; the bound only ends a hang
        threads["forward"] = threading.current_thread()
        order.append(("forward", step))

    hooks.before_forward = before_forward
    while "A" not in pair.out.reasons:
        sched.step()
    assert sched.step_count == 6 and ("forward", 6) not in order
    a_slots = sched.worker.runner.req_to_token_pool.req_to_token[1, :11].clone()
    pair.submit("B", [8, 9, 10], SamplingParams(max_new_tokens=8, ignore_eos=True))
    sched.process_input_requests()
    sched.pop_preallocated()
    pair.prefill()
    sched.process_input_requests()
    sched.running_batch = sched.running_batch.filter_unfinished().merge(sched.get_new_prebuilt_batch())
    # no wait here: the schedule side has returned, so a write it made on its own thread is in `order`
    # by now; one handed to any thread but the forward stream's is caught below by the thread it ran on
    assert ("row write", 1) not in order[1:], "B's row was written while the previous forward was in flight"
    assert torch.equal(sched.worker.runner.req_to_token_pool.req_to_token[1, :11], a_slots)
    latch.set()
    pair.close()
    # on CPU the forward stream is one thread running work in submission order (streams.py): B's row
    # write is ordered after forward 6 only when it ran there, after it; from any other thread it is
    # unordered with forward 6's reads, whatever the timing
    assert all(t is threads["forward"] for t in threads["row writes"]), [t.name for t in threads["row writes"]]
    assert order.index(("row write", 1), 1) > order.index(("forward", 6))
    assert pair.out.tokens["A"] == ref and pair.out.reasons["A"] == "stop"
    assert pair.out.tokens["B"] == hf_greedy(path, [8, 9, 10], 8)


def test_8_prebuilt_batch_seeds_future_rows(checkpoint):
    pair = ManualPair(checkpoint("qwen3"))
    sched = pair.scheduler
    pair.submit("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=5, ignore_eos=True))
    sched.step()
    pair.prefill()
    sched.process_input_requests()
    batch = sched.get_new_prebuilt_batch()
    sched.worker.synchronize(timeout=5)
    row = batch.req_pool_indices_cpu[0].item()
    assert sched.worker.future_map.token_ids[row].item() == pair.out.tokens["r"][0]
    assert sched.worker.future_map._writes["token_ids"][row].item() == 1
    assert batch.kv_committed_lens_cpu.tolist() == [4]
    sched.running_batch = sched.running_batch.merge(batch)
    pair.close()
    assert pair.out.reasons["r"] == "length" and len(pair.out.tokens["r"]) == 5


def test_6_a_step_on_the_buffer_itself_is_guarded_as_a_gather_and_a_stash():
    """tokens_in_place (a step that gathers and stashes in its own call): in debug mode it checks what a
    gather checks, and leaves one write per row, so the next gather passes only after it."""
    fm = _fm()
    rows = _idx(1, 2)
    with pytest.raises(ConsumeOnceError):
        fm.tokens_in_place(rows)  # never written
    fm.stash_tokens(rows, _idx(5, 6))
    buffer = fm.tokens_in_place(rows)
    assert buffer is fm.token_ids and buffer[rows].tolist() == [5, 6]
    buffer[rows] = _idx(7, 8)  # the step's own stash
    assert fm.gather_tokens(rows).tolist() == [7, 8]
    with pytest.raises(ConsumeOnceError):
        fm.tokens_in_place(rows)  # gathered since, not written
    assert _fm(debug=False).tokens_in_place(rows) is not None  # unchecked outside debug mode
