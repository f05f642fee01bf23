"""KV on demand and retraction on decode (decode_service/kv_growth.py), with the fake worker: admission
by what requests use, growth before each step, retraction when the pool runs dry (every token still
the scripted one, none twice, every slot freed once), invariant 9 under overlap, and a requester that
can neither grow nor retract anyone ending with an error."""

from __future__ import annotations

import pytest

from decode_service.hooks import DecodeHooks
from decode_service.kv_growth import MAX_RETRACTIONS
from decode_service.req import ReqState
from tests.fake_worker import EOS
from tests.test_scheduler import EAGLE, Driver


class RetractAt(DecodeHooks):
    """Retract request `rid` before step `step` (each pair once)."""

    def __init__(self, *pairs):
        self.pairs = set(pairs)

    def retract(self, step, reqs):
        hit = [r for r in reqs if (r.rid, step) in self.pairs]
        self.pairs -= {(r.rid, step) for r in hit}
        return hit


def _ends_at(rid: str, n: int) -> dict:
    return {(rid, n - 1): EOS}


@pytest.mark.parametrize("reservation", ["full", "on-demand"])
def test_admission_holds_what_requests_use_not_what_they_declare(reservation):
    """Four requests declaring 100 new tokens that answer in 6: the full reservation runs them one at a
    time in a 128-slot pool, on demand all four run at once."""
    overrides = {k: v for i in range(4) for k, v in _ends_at(f"r{i}", 6).items()}
    d = Driver(kv_reservation=reservation, grow=8, kv_slots=128, overrides=overrides)
    for i in range(4):
        d.submit(f"r{i}", prompt_len=4, max_new=100)
    most = 0
    for _ in range(200):
        d.deliver()
        d.step()
        most = max(most, sum(r.state == ReqState.RUNNING for r in d.sched.reqs.values()))
        if d.sched.idle and not d.pending:
            break
    d.check_free()
    for i in range(4):
        assert d.tokens[f"r{i}"] == d.expected(f"r{i}", 5) + [EOS] and d.reasons[f"r{i}"] == "stop"
    assert most == (1 if reservation == "full" else 4)


@pytest.mark.parametrize("spec", [None, EAGLE], ids=["plain", "eagle"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_dry_pool_retracts_and_every_token_stays_the_scripted_one(overlap, spec):
    """Six requests whose answers together need more KV than the pool: growth runs dry, requests are
    retracted and come back re-prefilled from prompt + outputs; each gets exactly its scripted tokens."""
    extra = spec.extra_slots if spec else 0
    d = Driver(overlap=overlap, spec=spec, grow=4, kv_slots=3 * (6 + 24 + extra), req_slots=6)
    for i in range(6):
        d.submit(f"r{i}", prompt_len=6, max_new=24)
    d.run(max_steps=2000)
    for i in range(6):
        assert d.tokens[f"r{i}"] == d.expected(f"r{i}", 24) and d.reasons[f"r{i}"] == "length", i
    assert d.sched.growth.retractions > 0


def test_9_a_retracted_lane_in_flight_is_processed_once_and_its_row_reseeded_only_by_its_new_prebuilt():
    """Invariant 9: under overlap, a request retracted while step N (which holds its lane) is in flight
    leaves step N+1, frees its row and slots at once (stream work after step N), keeps step N's token
    (streamed once), and its row is seeded again only by the prebuilt write of its re-prefill."""
    d = Driver(overlap=True, hooks=RetractAt(("a", 3)))
    d.submit("a", max_new=8)
    d.submit("b", max_new=8)
    for _ in range(3):
        d.deliver()
        d.step()
    row = d.sched.reqs["a"].req_pool_idx
    assert d.sched.step_count == 2 and d.sched.last_launched is not None  # step 2 holds a's lane, in flight
    d.step()  # builds step 3: "a" is retracted; step 2 is processed after step 3's launch
    a = d.sched.reqs["a"]
    assert a.state == ReqState.WAITING and a.kv_slots is None and a.retractions == 1
    log = d.worker.log
    release = log.index(("release", row))
    step2 = max(i for i, e in enumerate(log) if e[0] == "forward" and row in e[2])
    assert log[step2][1] == 2 and step2 < release, "the row was released before the forward still holding its lane"
    assert not any(e[0] == "forward" and row in e[2] for e in log[release:]), "a step after the release read it"
    got = len(d.tokens["a"])
    assert got == 3 and d.tokens["a"] == d.expected("a", got)  # the first token, steps 1 and 2's: once each
    d.run()
    assert d.tokens["a"] == d.expected("a", 8) and d.tokens["b"] == d.expected("b", 8)
    assert any(e[0] == "prebuilt" for e in d.worker.log[release:]), "its re-prefill was never seeded"


def test_a_request_that_can_neither_grow_nor_retract_ends_with_an_error_naming_the_pool():
    """ "a" has been retracted MAX_RETRACTIONS times; it needs to grow while "b" holds the rest of the pool
    awaiting its handoff: no running request is left to retract, so "a" fails, its slots freed once."""
    d = Driver(overlap=False, grow=2, kv_slots=17)
    d.submit("a", prompt_len=4, max_new=12)
    d.step()
    d.deliver()
    d.step()
    d.sched.reqs["a"].retractions = MAX_RETRACTIONS  # as if retracted that often already
    d.submit("b", prompt_len=4, max_new=12)
    d.step()  # "b" reserves its prompt + 2 (leaving 2 free for "a"), and awaits its handoff
    assert "b" in d.pending
    for _ in range(20):
        d.step()
        if "a" in d.reasons:
            break
    assert d.reasons["a"] == "error" and "cannot give request a" in d.finishes["a"].error
    assert d.sched.reqs.get("a") is None  # released
    d.run()
    assert d.tokens["b"] == d.expected("b", 12) and d.reasons["b"] == "length"


@pytest.mark.parametrize("overlap", [True, False])
def test_n_samples_retracted_come_back_alone_with_their_own_tokens(overlap):
    """n = 3 in a dry pool: samples are retracted (the group's shared prompt slots freed with its last
    holder) and re-prefilled alone under their own id and seed; each sample gets its scripted tokens."""
    d = Driver(overlap=overlap, grow=4, kv_slots=3 * (6 + 3 * 20) // 2, req_slots=6)
    for i in range(2):
        d.submit(f"r{i}", prompt_len=6, max_new=20, n=3)
    d.run(max_steps=2000)
    for i in range(2):
        for rid in (f"r{i}", f"r{i}/1", f"r{i}/2"):
            assert d.tokens[rid] == d.expected(rid, 20) and d.reasons[rid] == "length", rid
    assert d.sched.growth.retractions > 0


def test_an_abort_ends_every_sample_of_a_request_whose_samples_were_retracted():
    d = Driver(overlap=True, hooks=RetractAt(("r/1", 3), ("r", 3)))
    d.submit("r", max_new=12, n=3)
    for _ in range(4):
        d.deliver()
        d.step()
    assert d.sched.reqs["r/1"].retractions == 1 and d.sched.reqs["r"].retractions == 1
    d.sched.abort("r")
    d.step()
    assert {d.reasons[rid] for rid in ("r", "r/1", "r/2")} == {"abort"}
    d.run()  # a late handoff of a re-prefill is dropped; every slot freed once
