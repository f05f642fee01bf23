"""The decode scheduler driven by a FakeWorker: no model, each case in milliseconds.

The end-to-end proof stays in the HF-parity tests; these pin the scheduler's own rules: admission in
order, the handoff and prebuilt path, finishing, abort in every stage, the overlap lag, EAGLE's
published lengths, and that every slot is freed exactly once.
"""

from __future__ import annotations

import time

import pytest
import torch

from common.engine.draft_runner import SpecArgs
from common.engine.sampling import SamplingParams
from decode_service.output import Finish, RequestOutput
from decode_service.scheduler import DecodeScheduler
from tests.fake_worker import EOS, FakeWorker, token_of

EAGLE = SpecArgs(algorithm="EAGLE", draft_model_path="unused", num_steps=3, num_draft_tokens=4)


class Driver:
    """A scheduler stepped by hand; prefill requests wait in `pending` until `deliver`."""

    def __init__(self, overlap: bool = True, kv_reservation: str = "on-demand", grow: int = 32, **worker_kw):
        self.worker = FakeWorker(**worker_kw)
        self.pending = {}
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.finishes: dict[str, Finish] = {}
        self.cancelled: list[str] = []  # the prefill calls the scheduler cancelled
        self.sched = DecodeScheduler(
            self.worker,
            self._prefill,
            overlap=overlap,
            debug=True,
            cancel_prefill=self.cancelled.append,
            kv_reservation=kv_reservation,
            kv_grow_tokens=grow,
        )

    def _prefill(self, request):
        self.pending[request.rid] = request

    def _out(self, out: RequestOutput):
        assert out.rid not in self.reasons, f"{out.rid}: output after its finish"
        self.tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        if out.finish is not None:
            self.reasons[out.rid] = out.finish.reason
            self.finishes[out.rid] = out.finish

    def submit(self, rid: str, prompt_len: int = 4, max_new: int = 6, **params):
        prompt = list(range(20, 20 + prompt_len))
        self.sched.submit(rid, prompt, SamplingParams(max_new_tokens=max_new, **params), self._out)

    def deliver(self, *rids: str):
        for rid in rids or list(self.pending):
            self.sched.inbox.deliver_handoff(self.worker.handoff(self.pending.pop(rid)))

    def step(self, n: int = 1):
        for _ in range(n):
            self.sched.step()

    def run(self, max_steps: int = 200):
        """Step (delivering every prefill at once) until idle; then the books must balance."""
        for _ in range(max_steps):
            self.deliver()
            self.sched.step()
            if self.sched.idle and not self.pending:
                break
        else:
            raise AssertionError("not idle")
        self.check_free()

    def check_free(self):
        self.sched.check_integrity()
        assert self.worker.kv_allocator.num_used == 0
        assert self.worker.req_to_token_pool.allocator.num_used == 0

    def expected(self, rid: str, n: int) -> list[int]:
        return [self.worker.token(rid, i) for i in range(n)]


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_get_their_scripted_tokens_and_free_everything(overlap):
    d = Driver(overlap=overlap)
    for i in range(6):  # more requests than request slots: the rest wait for a slot
        d.submit(f"r{i}", prompt_len=3 + i, max_new=2 + i)
    d.run()
    for i in range(6):
        assert d.tokens[f"r{i}"] == d.expected(f"r{i}", 2 + i) and d.reasons[f"r{i}"] == "length"


def test_admission_is_in_order_and_all_or_nothing():
    d = Driver(kv_slots=20)
    d.submit("big", prompt_len=4, max_new=12)  # needs 16 of 20 KV slots
    d.submit("next", prompt_len=4, max_new=4)  # needs 8: fits only once "big" is gone
    d.submit("small", prompt_len=1, max_new=1)  # would fit now, but waits behind "next"
    d.step()
    assert set(d.pending) == {"big"} and [r.rid for r in d.sched.waiting] == ["next", "small"]
    assert d.worker.kv_allocator.num_used == 16 and d.worker.req_to_token_pool.allocator.num_used == 1
    d.run()
    assert d.reasons == {"big": "length", "next": "length", "small": "length"}


def test_prebuilt_batch_streams_the_first_token_and_seeds_the_row_before_any_forward():
    d = Driver()
    d.submit("a", max_new=3)
    d.step()
    d.deliver("a")
    d.sched.process_input_requests()
    batch = d.sched.get_new_prebuilt_batch()
    assert d.tokens["a"] == [token_of("a", 0)] and batch.kv_committed_lens_cpu.tolist() == [4]
    assert d.worker.log == [("prebuilt", batch.req_pool_indices_cpu[0].item())]  # no forward ran
    d.sched.running_batch = batch
    d.run()
    assert d.tokens["a"] == d.expected("a", 3)


@pytest.mark.parametrize("overlap", [True, False])
def test_finish_on_eos_and_stop_tokens_drops_what_follows(overlap):
    d = Driver(overlap=overlap, overrides={("eos", 2): EOS, ("stop", 1): 77, ("ignore", 1): EOS})
    d.submit("eos", max_new=8)
    d.submit("stop", max_new=8, stop_token_ids=(77,))
    d.submit("ignore", max_new=3, ignore_eos=True)
    d.run()
    assert d.tokens["eos"] == d.expected("eos", 2) + [EOS] and d.reasons["eos"] == "stop"
    assert d.tokens["stop"] == [token_of("stop", 0), 77] and d.reasons["stop"] == "stop"
    assert d.tokens["ignore"] == [token_of("ignore", 0), EOS, token_of("ignore", 2)]


def test_the_finish_record_carries_what_the_front_door_reports():
    """The last RequestOutput of a request carries its Finish: the reason, the stop id it matched and
    the prompt tokens the handoff took from a prefix cache; a trace given at submit rides on to the
    prefill request."""
    d = Driver(overrides={("stop", 1): 77})
    d.submit("stop", max_new=8, stop_token_ids=(77,))
    d.submit("length", max_new=3)
    d.sched.submit("traced", [5, 6], SamplingParams(max_new_tokens=2), d._out, trace=("parent", 123))
    d.step()
    assert d.pending["traced"].trace == ("parent", 123) and d.pending["stop"].trace is None
    for request in [d.pending.pop(rid) for rid in list(d.pending)]:
        handoff = d.worker.handoff(request)
        handoff.cached_tokens = 2
        d.sched.inbox.deliver_handoff(handoff)
    d.run()
    assert d.finishes["stop"] == Finish("stop", matched_stop=77, cached_tokens=2)
    assert d.finishes["length"] == d.finishes["traced"] == Finish("length", cached_tokens=2)


def test_abort_in_every_stage_frees_exactly_once():
    d = Driver(req_slots=3)
    for rid in ["running", "prebuilt", "awaiting", "waiting"]:
        d.submit(rid, max_new=20)
    d.step()
    d.deliver("running")
    d.step(2)
    d.deliver("prebuilt")
    d.sched.process_input_requests()  # "prebuilt" is queued for the next prebuilt batch
    assert [r.rid for r in d.sched.prebuilt] == ["prebuilt"] and set(d.pending) == {"awaiting"}
    assert [r.rid for r in d.sched.waiting] == ["waiting"] and len(d.sched.running_batch) == 1
    for rid in ["waiting", "awaiting", "prebuilt", "running", "running"]:  # the second is a no-op
        d.sched.abort(rid)
    d.step(3)
    d.deliver("awaiting")  # a handoff for an aborted request is dropped, not written
    d.step(2)
    assert d.reasons == dict.fromkeys(["waiting", "awaiting", "prebuilt", "running"], "abort")
    assert d.cancelled == ["awaiting"]  # the one door cancels the one prefill call still running, once
    assert sum(1 for op in d.worker.log if op[0] == "prebuilt") == 1  # only "running" was ever seeded
    assert d.sched.idle
    d.check_free()


def test_a_failed_or_malformed_handoff_fails_the_request_once():
    d = Driver()
    d.submit("failed")
    d.submit("bad")
    d.step()
    d.sched.inbox.fail_handoff("failed", "peer went away")
    d.sched.inbox.fail_handoff("failed", "second report")  # must not free twice
    bad = d.worker.handoff(d.pending.pop("bad"))
    bad.prompt_ids = bad.prompt_ids[:-1]
    d.sched.inbox.deliver_handoff(bad)
    d.pending.pop("failed")
    d.step()
    assert d.reasons == {"failed": "error", "bad": "error"}
    assert d.finishes["failed"].error == "peer went away"
    assert "prefilled ids differ" in d.finishes["bad"].error
    d.check_free()


def test_duplicate_request_id_is_refused_without_touching_the_first():
    d = Driver()
    d.submit("x", max_new=3)
    seen = []
    d.sched.submit("x", [5, 6], SamplingParams(max_new_tokens=2), lambda out: seen.append(out.finish.reason))
    d.run()
    assert seen == ["abort"] and d.tokens["x"] == d.expected("x", 3)


def test_overlap_processes_step_n_after_launching_step_n_plus_1():
    d = Driver(overlap=True)
    d.submit("a", max_new=4)
    d.step()
    d.deliver("a")
    d.step()  # prebuilt + launch step 1; nothing to process yet
    assert d.tokens["a"] == [token_of("a", 0)] and d.sched.last_launched.result.step == 1
    d.step()  # launch step 2, then process step 1
    assert [op[1] for op in d.worker.log if op[0] == "forward"] == [1, 2]
    assert d.tokens["a"] == d.expected("a", 2)
    d.run()
    # "a" reached max_new_tokens at step 3: known when step 4 would have been built, so no step 4
    assert [op[1] for op in d.worker.log if op[0] == "forward"] == [1, 2, 3]
    assert d.tokens["a"] == d.expected("a", 4)


def test_overlap_a_request_ended_by_a_stop_token_rides_one_wasted_lane():
    """A stop token is seen only when its step is processed, after the next step was launched: that
    lane's result is skipped (nothing past the stop is streamed) and the request is released once."""
    d = Driver(overlap=True)
    d.submit("b", max_new=8, stop_token_ids=(token_of("b", 2),))
    d.run()
    assert d.tokens["b"] == d.expected("b", 3) and d.reasons["b"] == "stop"
    assert [op[1] for op in d.worker.log if op[0] == "forward"] == [1, 2, 3]  # step 3: the wasted lane
    assert [op for op in d.worker.log if op[0] == "release"] == [("release", 1)]


def test_without_overlap_each_step_is_processed_before_the_next_launch():
    d = Driver(overlap=False)
    d.submit("a", max_new=4)
    d.step()
    d.deliver("a")
    d.step()
    assert d.tokens["a"] == d.expected("a", 2)
    d.run()
    assert [op[1] for op in d.worker.log if op[0] == "forward"] == [1, 2, 3]


def test_7_a_reused_row_is_written_only_after_the_forward_that_still_reads_it():
    d = Driver(req_slots=1, overlap=True)
    d.submit("A", max_new=3)
    d.submit("B", max_new=3)
    d.run()
    log = d.worker.log
    a_last = max(
        i for i, op in enumerate(log) if op[0] == "forward" and op[2] == (1,) and i < log.index(("release", 1))
    )
    b_seed = [i for i, op in enumerate(log) if op == ("prebuilt", 1)][1]
    assert a_last < log.index(("release", 1)) < b_seed  # A's wasted lane, A's release, then B's seed
    assert d.tokens["B"] == d.expected("B", 3)


def test_output_callback_that_raises_aborts_only_its_request():
    d = Driver()
    d.submit("alive", max_new=5)
    d.sched.submit("broken", [5, 6, 7], SamplingParams(max_new_tokens=30), lambda *a: 1 / 0)
    d.run()
    assert d.tokens["alive"] == d.expected("alive", 5) and "broken" not in d.sched.reqs


def test_a_failed_step_fails_every_live_request_and_the_loop():
    d = Driver()
    d.worker.fail_at_step = 2
    d.submit("a", max_new=10)
    d.submit("b", max_new=10)
    d.sched.start()
    try:
        for _ in range(500):
            d.deliver()
            if len(d.reasons) == 2:
                break
            d.sched.inbox.wake.set()
            time.sleep(0.002)
        assert d.reasons == {"a": "error", "b": "error"} and not d.sched.alive
        assert "step 2 broke" in repr(d.sched.fatal_error)
        assert "step 2 broke" in d.finishes["a"].error  # the detail travels in the Finish
    finally:
        d.sched.stop()


# ---- EAGLE ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False])
def test_eagle_commits_accept_len_tokens_and_resolves_published_lengths(overlap):
    accept = {"a": [3, 0, 2, 1, 3, 3, 0], "b": [0, 0, 1, 3, 2, 2, 2]}
    calls = {"a": 0, "b": 0}

    def scripted(rid, step):
        calls[rid] += 1
        return accept[rid][(calls[rid] - 1) % 7]

    d = Driver(overlap=overlap, spec=EAGLE, accept=scripted)
    d.submit("a", prompt_len=5, max_new=17)
    d.submit("b", prompt_len=2, max_new=9)
    d.run()  # FakeWorker asserts every step starts from the length it published last
    assert d.tokens["a"] == d.expected("a", 17) and d.tokens["b"] == d.expected("b", 9)
    accepted, drafted = d.sched.spec_stats
    steps = drafted // EAGLE.num_steps  # lanes whose results counted (overlap also runs wasted lanes)
    assert drafted % EAGLE.num_steps == 0 and steps <= sum(calls.values()) and 0 < accepted < drafted


def test_eagle_finish_counts_each_requests_own_drafts():
    d = Driver(spec=EAGLE, accept=lambda rid, step: 1 if rid == "a" else 2)
    d.submit("a", max_new=9)
    d.submit("b", max_new=9)
    d.run()
    a, b = d.finishes["a"], d.finishes["b"]
    assert a.spec_drafted and a.spec_accepted * EAGLE.num_steps == a.spec_drafted
    assert b.spec_drafted and b.spec_accepted * EAGLE.num_steps == 2 * b.spec_drafted
    assert (a.spec_accepted + b.spec_accepted, a.spec_drafted + b.spec_drafted) == tuple(d.sched.spec_stats)


def test_eagle_reserves_the_draft_window_past_prompt_and_max_new_tokens():
    d = Driver(spec=EAGLE, kv_slots=4 + 6 + EAGLE.extra_slots)
    d.submit("a", prompt_len=4, max_new=6)
    d.step()
    assert d.worker.kv_allocator.num_used == 4 + 6 + EAGLE.extra_slots
    d.run()  # FakeWorker asserts no step writes past the reservation
    assert d.tokens["a"] == d.expected("a", 6)


def test_eagle_tokens_past_a_finish_are_dropped():
    d = Driver(spec=EAGLE, accept=lambda rid, step: 3, overrides={("a", 2): EOS})
    d.submit("a", max_new=10)
    d.run()
    assert d.tokens["a"] == d.expected("a", 2) + [EOS] and d.reasons["a"] == "stop"


def test_eagle_lengths_are_resolved_once_per_publish_and_never_for_finished_rows():
    d = Driver(spec=EAGLE, req_slots=1, accept=lambda rid, step: 3)
    d.submit("a", max_new=5)  # finishes at its second step; its row is reused by "b" at once
    d.submit("b", max_new=5)
    d.run()  # the fake fails any resolve of a row without a publish since its last resolve
    assert d.tokens["b"] == d.expected("b", 5)
    d.worker._published[1] = 9
    d.worker.resolve_kv_committed_lens_cpu(torch.tensor([1]))
    with pytest.raises(AssertionError, match="without a publish"):  # the check itself can fail
        d.worker.resolve_kv_committed_lens_cpu(torch.tensor([1]))


@pytest.mark.parametrize("spec", [None, EAGLE])
def test_a_request_larger_than_the_pool_is_refused_at_submit_and_the_queue_moves(spec):
    """23.1: prompt + max_new_tokens (+ EAGLE's draft window) over the whole pool never fits; it was
    queued and waited forever, and every request behind it too."""
    from common.request_rules import InvalidRequest

    extra = EAGLE.extra_slots if spec else 0
    d = Driver(kv_slots=64 + extra, spec=spec)
    with pytest.raises(InvalidRequest, match="--max-total-tokens"):
        d.submit("huge", prompt_len=10, max_new=100)
    d.submit("fits", prompt_len=10, max_new=54)  # exactly the room
    d.submit("small", prompt_len=5, max_new=4)
    d.run()
    assert d.reasons == {"fits": "length", "small": "length"} and d.sched.books.room == 64
