"""In-process prefill -> decode: token-exact with HF, overlap on and off; finishes and aborts."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from common.engine.sampling import SamplingParams
from decode_service.req import ReqState
from tests.decode_harness import ManualPair, Pair
from tests.oracle import hf_greedy

NEW = 24


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 40, 13, 7, 22, 3, 9, 17, 2][:n]
    return [torch.randint(5, 384, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_staggered_arrivals_match_hf_with_and_without_overlap(checkpoint, arch):
    path = checkpoint(arch)
    prompts = _prompts(10)
    results = {}
    for overlap in (True, False):
        pair = Pair(path, overlap=overlap)
        try:
            decoding_at_arrival = 0
            for i, p in enumerate(prompts):
                if i in (3, 6, 8):  # later ones arrive while earlier ones decode
                    pair.wait_tokens(str(i - 1), 3)
                    decoding_at_arrival += sum(
                        1 for r, t in list(pair.out.tokens.items()) if t and r not in pair.out.reasons
                    )
                pair.submit(str(i), p, SamplingParams(max_new_tokens=NEW - (i % 3), ignore_eos=True))
            pair.wait([str(i) for i in range(len(prompts))])
            assert decoding_at_arrival > 0
        finally:
            pair.close()
        results[overlap] = pair.out
        assert pair.scheduler.step_count > NEW
    for i, p in enumerate(prompts):
        ref = hf_greedy(path, p, NEW - (i % 3))
        assert results[True].tokens[str(i)] == ref, f"overlap, prompt {i}"
        assert results[False].tokens[str(i)] == ref, f"no overlap, prompt {i}"
        assert results[True].reasons[str(i)] == results[False].reasons[str(i)] == "length"


def test_max_new_tokens_one_and_stop_token_ids(checkpoint):
    path = checkpoint("qwen2")
    p = _prompts(3)[2]
    ref = hf_greedy(path, p, 12)
    k = next(i for i in range(3, 12) if ref[i] not in ref[:i])  # first occurrence at k
    pair = Pair(path)
    try:
        pair.submit("one", p, SamplingParams(max_new_tokens=1, ignore_eos=True))
        pair.submit("stop", p, SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(ref[k],)))
        pair.submit("first", p, SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(ref[0],)))
        pair.wait(["one", "stop", "first"])
    finally:
        pair.close()
    assert pair.out.tokens["one"] == ref[:1] and pair.out.reasons["one"] == "length"
    assert pair.out.tokens["stop"] == ref[: k + 1] and pair.out.reasons["stop"] == "stop"
    assert pair.out.tokens["first"] == ref[:1] and pair.out.reasons["first"] == "stop"


def _with_eos(checkpoint, tmp_path, eos: int) -> str:
    path = str(tmp_path / "eos")
    shutil.copytree(checkpoint("llama"), path)
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(path, name)) as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = eos
        with open(os.path.join(path, name), "w") as f:
            json.dump(cfg, f)
    return path


@pytest.mark.parametrize("overlap", [True, False])
def test_eos_first_token_and_mid_generation(checkpoint, tmp_path, overlap):
    p = _prompts(4)[3]
    ref = hf_greedy(checkpoint("llama"), p, 16)
    k = next(i for i in range(2, 16) if ref[i] not in ref[:i])
    first = ManualPair(_with_eos(checkpoint, tmp_path / "a", ref[0]), overlap=overlap)
    mid = ManualPair(_with_eos(checkpoint, tmp_path / "b", ref[k]), overlap=overlap)
    for pair in (first, mid):
        pair.submit("eos", p, SamplingParams(max_new_tokens=16))
        pair.submit("ignore", p, SamplingParams(max_new_tokens=16, ignore_eos=True))
        pair.scheduler.step()
        pair.prefill()
        pair.close()
        assert pair.out.tokens["ignore"] == ref and pair.out.reasons["ignore"] == "length"
    assert first.out.tokens["eos"] == ref[:1] and first.out.reasons["eos"] == "stop"
    assert mid.out.tokens["eos"] == ref[: k + 1] and mid.out.reasons["eos"] == "stop"


@pytest.mark.parametrize("overlap", [True, False])
def test_aborts_in_every_stage(checkpoint, overlap):
    path = checkpoint("qwen3")
    prompts = _prompts(5)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    # KV for two requests only (fully reserved), so the third waits in the admission queue
    pair = ManualPair(path, overlap=overlap, decode_tokens=(40 + 20) + (5 + 20) + 5, kv_reservation="full")
    sched = pair.scheduler
    pair.submit("running", prompts[2], params)
    pair.submit("awaiting", prompts[1], params)
    pair.submit("queued", prompts[3], params)
    sched.step()
    awaiting = {r.rid for r in sched.reqs_in(ReqState.AWAITING_HANDOFF)}
    assert [r.rid for r in sched.waiting] == ["queued"] and awaiting == {"running", "awaiting"}
    sched.abort("queued")
    sched.abort("awaiting")  # its prefill is still in flight
    sched.step()
    assert pair.out.reasons == {"queued": "abort", "awaiting": "abort"}
    pair.prefill()  # a late handoff for "awaiting" is dropped
    for _ in range(5):
        sched.step()
    assert len(pair.out.tokens["running"]) >= 3
    sched.abort("running")
    # a new request aborted after its handoff arrived but before its prebuilt batch ran
    pair.submit("prebuilt", prompts[0], params)
    sched.step()
    pair.prefill("prebuilt")
    sched.abort("prebuilt")
    pair.submit("survivor", prompts[4], params)
    sched.step()
    pair.prefill()
    pair.close()
    assert pair.out.reasons["running"] == "abort" and pair.out.reasons["prebuilt"] == "abort"
    assert "prebuilt" not in pair.out.tokens or pair.out.tokens["prebuilt"] == []
    assert pair.out.tokens["survivor"] == hf_greedy(path, prompts[4], 20)
    n = len(pair.out.tokens["running"])
    assert pair.out.tokens["running"] == hf_greedy(path, prompts[2], 20)[:n] and n < 20


def test_kv_pressure_queues_and_finishes_all(checkpoint):
    path = checkpoint("llama")
    prompts = _prompts(10, seed=5)
    # room for ~3 requests at a time out of 10
    pair = Pair(path, decode_tokens=3 * (40 + 16), decode_reqs=8)
    try:
        for i, p in enumerate(prompts):
            pair.submit(str(i), p, SamplingParams(max_new_tokens=16, ignore_eos=True))
        pair.wait([str(i) for i in range(10)])
    finally:
        pair.close()
    for i, p in enumerate(prompts):
        assert pair.out.tokens[str(i)] == hf_greedy(path, p, 16)


def test_bad_requests_rejected_before_admission(checkpoint):
    pair = ManualPair(checkpoint("qwen2"))
    with pytest.raises(ValueError, match="exceeds the context"):
        pair.submit("long", [5] * 500, SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="empty prompt"):
        pair.submit("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        pair.submit("oov", [1, 10_000], SamplingParams())
    assert pair.scheduler.inbox.empty()
    pair.close()


def test_broken_handoff_frees_the_reservation_once(checkpoint):
    pair = ManualPair(checkpoint("qwen2"))
    p = _prompts(2)[1]
    pair.submit("broken", p, SamplingParams(max_new_tokens=8))
    pair.submit("malformed", p, SamplingParams(max_new_tokens=8))
    pair.scheduler.step()
    pair.scheduler.inbox.fail_handoff("broken", "peer went away")
    [bad] = pair.prefill_worker.prefill([r for r in pair.pending if r.rid == "malformed"])
    pair.pending.clear()
    bad.k = bad.k[:-1]
    pair.scheduler.inbox.deliver_handoff(bad)
    pair.scheduler.inbox.fail_handoff("broken", "second report")  # must not free twice
    pair.close()
    assert pair.out.reasons == {"broken": "error", "malformed": "error"}


def test_seeded_sampling_continues_across_the_handoff(checkpoint):
    """Prefill samples output 0 and decode the rest from (seed, position): same as one process."""
    from common.engine.colocated import ColocatedLoop
    from common.engine.model_runner import ModelRunner, RunnerArgs

    path = checkpoint("llama")
    prompts = _prompts(4, seed=11)
    params = [
        SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True) for i in range(4)
    ]
    colocated = ColocatedLoop(ModelRunner(RunnerArgs(path, max_total_tokens=512, max_running_requests=4)), 16)
    reference = [r.output for r in colocated.generate(prompts, params)]
    pair = Pair(path)
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            pair.submit(str(i), p, sp)
        pair.wait([str(i) for i in range(4)])
    finally:
        pair.close()
    assert [pair.out.tokens[str(i)] for i in range(4)] == reference
    assert reference[0] != hf_greedy(path, prompts[0], 16)  # really sampled, not greedy


def test_failing_consumer_is_aborted_and_stop_frees_live_requests(checkpoint):
    pair = ManualPair(checkpoint("qwen2"))
    sched = pair.scheduler

    def broken(out):
        raise OSError("client went away")

    sched.submit("broken", [5, 6, 7], SamplingParams(max_new_tokens=30, ignore_eos=True), broken)
    pair.submit("alive", [8, 9], SamplingParams(max_new_tokens=30, ignore_eos=True))
    sched.step()
    pair.prefill()
    for _ in range(4):
        sched.step()
    assert "broken" not in sched.reqs and len(pair.out.tokens["alive"]) >= 3
    sched.stop()  # "alive" is mid-decode: it finishes as aborted, its slots freed
    assert pair.out.reasons["alive"] == "abort"
    sched.check_integrity()
    assert sched.worker.runner.kv_allocator.num_used == 0


def test_retry_after_a_finishing_first_token_streams_nothing_more(checkpoint):
    """max_new_tokens=1: the first token was streamed, the handoff broke and was re-prefilled."""
    from common.engine.handoff import HandoffRequest

    pair = ManualPair(checkpoint("qwen2"))
    sched = pair.scheduler
    p = [5, 6, 7, 8]
    pair.submit("r", p, SamplingParams(max_new_tokens=1, ignore_eos=True))
    sched.step()
    [req] = pair.pending
    pair.pending.clear()
    [h0] = pair.prefill_worker.prefill([req])
    sched.inbox.deliver_first_token("r", h0.first_token, 0)  # attempt 1 streams its token, then breaks
    retry = HandoffRequest("r", p + [h0.first_token], req.params, req.seed, first_position=1)
    [h1] = pair.prefill_worker.prefill([retry])
    sched.inbox.deliver_first_token("r", h1.first_token, 1)  # attempt 2 would stream the next one
    sched.inbox.deliver_handoff(h1)
    pair.close()
    assert pair.out.tokens["r"] == [h0.first_token] and pair.out.reasons["r"] == "length"


def test_slots_freed_while_a_step_is_in_flight_wait_for_it_when_a_transfer_engine_writes_late():
    """With shm / Mooncake prefill writes a new request's reserved slots itself, unordered with decode's
    stream: a slot a finished request freed while the next step is in flight (which may still write it:
    the request rides in that step) goes back to the pool only once that step is done. The pool is a
    stack (the last freed slot is handed out first), so without the hold the next reservation gets
    exactly those slots (seen: EAGLE3 tree over shm with decode's cache, 2 of 6 runs off HF)."""
    from common.engine.req_to_token_pool import ReqToTokenPool
    from common.engine.slot_allocator import SlotAllocator
    from decode_service.req import DecodeReq
    from decode_service.slot_books import SlotBooks

    class Worker:
        def __init__(self):
            self.req_to_token_pool, self.kv_allocator = ReqToTokenPool(4, 64), SlotAllocator(64)

        def release_row(self, idx):
            pass

    params = SamplingParams(max_new_tokens=4)
    for hold in (False, True):
        books = SlotBooks(Worker(), extra=0, eagle=False)
        books.hold_while_in_flight = hold
        first = DecodeReq("a", [1, 2, 3, 4], params, 0)
        assert books.reserve(first, 4)
        mine = set(first.kv_slots.tolist())
        books.in_flight = 7  # step 7 was launched; its lane of "a" may still write a's slots
        books.free(first)
        second = DecodeReq("b", [5, 6], params, 0)
        assert books.reserve(second, 2)
        assert bool(mine & set(second.kv_slots.tolist())) != hold  # without the hold: a's slots, at once
        books.kv.check_integrity(holders=books.holders([second])[0])  # the held slots are accounted for
        books.settled(6)
        assert books.kv.num_used == len(second.kv_slots) + (len(mine) if hold else 0)
        books.settled(7)  # step 7 is done: a's slots are the pool's again
        assert books.kv.num_used == len(second.kv_slots)
