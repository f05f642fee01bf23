"""Decode's prefix cache and the delta handoff (issue 57, --disaggregation-decode-enable-radix-cache):
a follow-up turn whose prompt continues an earlier request (its prompt + answer + new tokens) takes the
KV of the earlier positions from decode's own cache and only the new positions' KV from prefill, over
every transport, and stays token-exact against HF; eviction under pool pressure, aborts and
retractions leave every slot held exactly once (the harnesses check the pools on close)."""

from __future__ import annotations

import pytest
import torch

from common.engine.handoff import prefix_digest
from common.engine.sampling import SamplingParams
from common.request_rules import KvStartRefused
from prefill_service.hooks import PrefillHooks
from tests.decode_harness import Pair
from tests.grpc_harness import GrpcPair, needs_mooncake
from tests.oracle import hf_greedy
from tests.test_metrics import _scrape

N = 8
FIRST = [5, 9, 14, 3, 22, 8, 17, 40]


def _turns(submit, wait, tokens, first=FIRST, turns=3):
    """Three turns of one conversation: each prompt is the last prompt + its answer + 3 new ids."""
    prompt, prompts = list(first), []
    for t in range(turns):
        rid = f"t{t}"
        submit(rid, prompt)
        wait(rid)
        prompts.append(prompt)
        prompt = prompt + tokens(rid) + [31 + t, 7, 2 + t]
    return prompts


@pytest.mark.parametrize("overlap", [True, False])
def test_follow_up_turns_are_served_from_decodes_cache_and_match_hf(checkpoint, overlap):
    path = checkpoint("llama")
    pair = Pair(path, overlap=overlap, prefix_cache=True)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    try:
        prompts = _turns(
            lambda rid, p: pair.submit(rid, p, params), lambda rid: pair.wait([rid]), lambda rid: pair.out.tokens[rid]
        )
        stats = pair.scheduler.books.cache.stats
    finally:
        pair.close()
    for t, p in enumerate(prompts):
        assert pair.out.tokens[f"t{t}"] == hf_greedy(path, p, N), t
    # turn 2 reuses turn 1's prompt and all its answer's fed-back positions; turn 3 likewise
    assert stats.cached_tokens == (len(prompts[0]) + N - 1) + (len(prompts[1]) + N - 1)


def _grpc_turns(path: str, transfer: str, cache: bool, prefill_tp: int = 1, decode_tp: int = 1):
    """(prompts, answers, handoff bytes) of three turns through a pair over `transfer`."""
    tp = dict(linear_layout="mkl") if prefill_tp * decode_tp > 1 else {}
    decode_kw = dict(disaggregation_decode_enable_radix_cache=cache, metrics_port=0, tp_size=decode_tp, **tp)
    pair = GrpcPair(path, transfer=transfer, prefill_kw=dict(tp_size=prefill_tp, **tp), decode_kw=decode_kw)
    outs = {}

    def submit(rid, p):
        outs[rid] = pair.collect(pair.generate(p, N, ignore_eos=True, rid=rid))[0]

    try:
        prompts = _turns(submit, lambda rid: None, lambda rid: outs[rid])
        metrics = _scrape(pair.decode.metrics_port)
    finally:
        pair.close()
    return prompts, outs, metrics["disagg_handoff_bytes_total"], metrics["disagg_decode_cache_hit_tokens_total"]


@pytest.mark.parametrize(
    "transfer,prefill_tp,decode_tp",
    [
        ("grpc", 1, 1),
        ("shm", 1, 1),
        pytest.param("mooncake", 1, 1, marks=needs_mooncake),
        ("grpc", 2, 1),
        ("shm", 1, 2),
    ],
)
def test_the_delta_handoff_moves_only_the_new_positions_kv(checkpoint, transfer, prefill_tp, decode_tp):
    """Over every transport, and with prefill and decode at different TP sizes (decode's ranks each keep
    their heads of the cached KV; the slot books are rank 0's)."""
    path = checkpoint("llama")
    runs = {cache: _grpc_turns(path, transfer, cache, prefill_tp, decode_tp) for cache in (False, True)}
    (prompts, outs, full_bytes, no_hits), (prompts_c, outs_c, delta_bytes, hits) = runs[False], runs[True]
    assert prompts == prompts_c and outs == outs_c
    for t, p in enumerate(prompts):
        assert outs[f"t{t}"] == hf_greedy(path, p, N), t
    total = sum(len(p) for p in prompts)
    sent = len(prompts[0]) + sum(len(p) - (len(prompts[i]) + N - 1) for i, p in enumerate(prompts[1:]))
    assert delta_bytes == pytest.approx(full_bytes * sent / total, rel=0.02), (full_bytes, delta_bytes)
    assert no_hits == 0 and hits == total - sent  # the metric counts the positions decode held


def test_eviction_under_pool_pressure_keeps_answers_exact_and_slots_balanced(checkpoint):
    """A pool that holds two conversations' KV: five conversations of two turns each evict each other's
    cached prefixes (least recently used first) rather than refusing or retracting anyone."""
    path = checkpoint("llama")
    pair = Pair(path, prefix_cache=True, decode_tokens=64, decode_reqs=4)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    firsts = [[(11 * c + j) % 300 + 3 for j in range(8)] for c in range(5)]
    try:
        all_prompts = []
        for c, first in enumerate(firsts):

            def submit(rid, p, c=c):
                pair.submit(f"c{c}{rid}", p, params)

            all_prompts.append(_turns(submit, lambda rid, c=c: pair.wait([f"c{c}{rid}"]),
                                      lambda rid, c=c: pair.out.tokens[f"c{c}{rid}"], first, turns=2))  # fmt: skip
        evicted = pair.scheduler.books.cache.tree.evicted_tokens
    finally:
        pair.close()
    assert evicted > 0
    for c, prompts in enumerate(all_prompts):
        for t, p in enumerate(prompts):
            assert pair.out.tokens[f"c{c}t{t}"] == hf_greedy(path, p, N), (c, t)


def test_aborted_and_concurrent_requests_on_a_shared_prefix_free_every_slot_once(checkpoint):
    path = checkpoint("llama")
    pair = Pair(path, prefix_cache=True)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    try:
        pair.submit("a", FIRST, params)
        pair.wait(["a"])
        follow = FIRST + pair.out.tokens["a"] + [3, 4]
        for i in range(4):  # four readers of the same cached prefix at once, one aborted mid-answer
            pair.submit(f"b{i}", follow + [i + 5], SamplingParams(max_new_tokens=40, ignore_eos=True))
        pair.wait_tokens("b1", 2)
        pair.scheduler.abort("b1")
        pair.wait([f"b{i}" for i in range(4)])
    finally:
        pair.close()
    assert pair.out.reasons["b1"] == "abort"
    for i in (0, 2, 3):
        assert pair.out.tokens[f"b{i}"] == hf_greedy(path, follow + [i + 5], 40), i


def test_prefill_refuses_a_kv_start_whose_digest_does_not_match(checkpoint):
    from common.wire.proto_gen import prefill_pb2
    from prefill_service import request_bounds

    class Runner:
        from common.models.config import load_model_config

        config = load_model_config(checkpoint("llama"))

    msg = prefill_pb2.PrefillRequest(request_id="r", input_ids=FIRST, kv_start=4, kv_start_digest=b"x" * 32)
    with pytest.raises(KvStartRefused, match="kv_start_digest"):  # FAILED_PRECONDITION: decode asks again, whole
        request_bounds.parse(msg, 1 << 20, Runner())
    msg.kv_start_digest = prefix_digest(FIRST[:4])
    assert request_bounds.parse(msg, 1 << 20, Runner()).kv_start == 4


class WrongDigest(PrefillHooks):
    """Spoils the kv_start_digest of the first `times` Prefill requests that start past position 0."""

    def __init__(self, times: int):
        self.left, self.spoiled = times, []

    def received(self, request) -> None:
        if request.kv_start and self.left:
            self.left -= 1
            request.kv_start_digest = bytes(32)
            self.spoiled.append(request.request_id)


@pytest.mark.parametrize("transfer", ["grpc", "shm"])
def test_a_refused_delta_handoff_is_asked_again_whole_and_stays_exact(checkpoint, transfer):
    """Prefill refuses a handoff from decode's cached prefix (its digest does not match: FAILED_PRECONDITION);
    decode frees the reservation and the prefix's lock and asks again for the whole prompt's KV, for n = 1
    and for an n = 2 group; the next turn's delta is served as usual. Every answer equals HF's greedy, the
    handoff bytes are two full prompts and one delta, and every slot is freed once (the harness's close)."""
    path = checkpoint("llama")
    hooks = WrongDigest(times=2)
    decode_kw = dict(disaggregation_decode_enable_radix_cache=True, metrics_port=0)
    pair = GrpcPair(path, transfer=transfer, decode_kw=decode_kw, prefill_hooks=hooks)
    outs, prompts = {}, [FIRST]
    try:
        for t, n in enumerate((1, 1, 2, 1)):
            responses = list(pair.generate(prompts[t], N, rid=f"t{t}", ignore_eos=True, n=n))
            completes = {r.complete.index: r.complete for r in responses if r.HasField("complete")}
            assert sorted(completes) == list(range(n)), responses[-1]
            outs[t] = [list(completes[i].output_ids) for i in range(n)]
            prompts.append(prompts[t] + outs[t][0] + [31 + t, 7, 2 + t])
            if t == 0:
                per_position = _scrape(pair.decode.metrics_port)["disagg_handoff_bytes_total"] / len(prompts[0])
            if t == 1:
                pair.wait_idle()
                held = pair.decode.scheduler.books.cache.tree.tree_size  # turns 0 and 1: prompt and answer
        metrics = _scrape(pair.decode.metrics_port)
    finally:
        pair.close()
    assert len(hooks.spoiled) == 2  # turns 1 and 2 were refused once each
    for t, n in enumerate((1, 1, 2, 1)):
        assert outs[t] == [hf_greedy(path, prompts[t], N)] * n, t
    assert held == len(prompts[1]) + N - 1
    assert metrics["disagg_decode_cache_refetches_total"] == 2
    hit = len(prompts[2])  # turn 3 reads turn 2's prompt (an n = 2 group leaves its prompt, not its answers)
    assert metrics["disagg_decode_cache_hit_tokens_total"] == hit  # the refused turns' matches not counted
    handed_off = sum(map(len, prompts[:3])) + len(prompts[3]) - hit  # turns 1 and 2 whole, turn 3 a delta
    assert metrics["disagg_handoff_bytes_total"] == pytest.approx(per_position * handed_off, rel=1e-6)


def test_a_follow_up_retracted_mid_answer_stays_exact(checkpoint):
    """Turn 2 reads turn 1's cached prefix, is retracted twice mid-answer (its KV joins the tree, its
    lock is dropped) and comes back re-prefilled: the answer is HF's, and every slot is freed once."""
    from tests.decode_harness import Hooks

    class RetractT1:  # retract t1 before its 3rd and 6th step
        def __init__(self):
            self.seen, self.done = 0, []

        def retract(self, step, reqs):
            hit = [r for r in reqs if r.rid == "t1"]
            self.seen += bool(hit)
            if hit and self.seen in (3, 6):
                self.done.append(step)
                return hit
            return []

    path = checkpoint("llama")
    hooks = RetractT1()
    pair = Pair(path, prefix_cache=True, hooks=Hooks(retract=hooks.retract), kv_grow_tokens=3)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    try:
        prompts = _turns(lambda rid, p: pair.submit(rid, p, params), lambda rid: pair.wait([rid]),
                         lambda rid: pair.out.tokens[rid], turns=2)  # fmt: skip
    finally:
        pair.close()
    assert len(hooks.done) == 2, hooks.done
    for t, p in enumerate(prompts):
        assert pair.out.tokens[f"t{t}"] == hf_greedy(path, p, N), t


@pytest.mark.parametrize("overlap", [True, False])
def test_n_samples_share_the_cached_prefix_and_leave_their_prompt_to_the_cache(checkpoint, overlap):
    """Turn 2 asks for n = 3 samples: the group reads turn 1's cached KV as its shared prompt (each
    sample decodes as an n = 1 request with its own seed, and the greedy group as HF's greedy), and once
    its last sample is freed the prompt's KV joins the cache, so turn 3 (the same prompt + a new message)
    finds it. An n = 2 group aborted at once (before or after its handoff) frees its slots and its lock
    (the harness checks every slot on close)."""
    from common.engine.sampling import sample_seed

    path = checkpoint("llama")
    pair = Pair(path, overlap=overlap, prefix_cache=True)
    greedy = SamplingParams(max_new_tokens=N, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=N, ignore_eos=True, temperature=1.0, seed=77, n=3)
    try:
        pair.submit("a", FIRST, greedy)
        pair.wait(["a"])
        follow = FIRST + pair.out.tokens["a"] + [3, 4]
        pair.submit("g", follow, SamplingParams(max_new_tokens=N, ignore_eos=True, n=2))
        pair.submit("s", follow, sampled)
        pair.submit("x", follow, SamplingParams(max_new_tokens=40, ignore_eos=True, n=2))
        pair.scheduler.abort("x")
        pair.wait(["g", "g/1", "s", "s/1", "s/2", "x"])
        cache = pair.scheduler.books.cache
        hits_after_groups = cache.stats.cached_tokens
        third = follow + [6, 7, 8]
        pair.submit("t", third, greedy)
        pair.wait(["t"])
        hits_third = cache.stats.cached_tokens - hits_after_groups
        singles = {}
        for i in range(3):  # sample i of "s" as an n = 1 request with seed sample_seed(77, i)
            one = SamplingParams(max_new_tokens=N, ignore_eos=True, temperature=1.0, seed=sample_seed(77, i))
            pair.submit(f"one{i}", follow, one)
            pair.wait([f"one{i}"])
            singles[i] = pair.out.tokens[f"one{i}"]
    finally:
        pair.close()
    turn1 = len(FIRST) + N - 1
    assert hits_after_groups in (2 * turn1, 3 * turn1)  # the groups read turn 1's KV ("x" too if admitted)
    assert hits_third == len(follow)  # the groups' prompt joined the cache (answers of n > 1 do not)
    want = hf_greedy(path, follow, N)
    assert pair.out.tokens["g"] == pair.out.tokens["g/1"] == want
    assert [pair.out.tokens[r] for r in ("s", "s/1", "s/2")] == [singles[i] for i in range(3)]
    assert pair.out.tokens["t"] == hf_greedy(path, third, N)


def _full_prefill(path: str, spec, prompt: list[int]):
    """The handoff of `prompt` prefilled whole by a fresh prefill worker (its head's KV over every position)."""
    from common.engine.handoff import HandoffRequest
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from prefill_service.worker import PrefillWorker

    worker = PrefillWorker(ModelRunner(RunnerArgs(path, max_total_tokens=512, max_running_requests=2, spec=spec)))
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    return worker.prefill([HandoffRequest("full", prompt, params, 0)])[0]


def _head_kv_read(pair, prompts, answers) -> dict:
    """The head's KV decode holds over two prompts, by prompt: turn 3's (in the tree once it finished)
    and a branch that edits turn 2's answer after 3 tokens (read while it runs: its match ends where the
    cached head KV was made with the old next token, so the last matched position must be prefilled)."""
    cache, pool = pair.scheduler.books.cache, pair.worker.runner.draft.kv_pool
    pair.wait_idle()  # turn 3's KV joins the tree once its slots are freed, after its last output
    slots = cache.tree.match_prefix(prompts[2])[0]
    assert len(slots) == len(prompts[2])
    held = {tuple(prompts[2]): (pool.k[0][slots], pool.v[0][slots])}
    old = answers["t1"][3]
    branch = prompts[1] + answers["t1"][:3] + [next(t for t in (50, 51) if t != old), 7]
    before = cache.stats.cached_tokens
    pair.submit("branch", branch, SamplingParams(max_new_tokens=40, ignore_eos=True))
    pair.wait_tokens("branch", 2)
    slots = pair.scheduler.reqs["branch"].kv_slots[: len(branch)]
    held[tuple(branch)] = (pool.k[0][slots].clone(), pool.v[0][slots].clone())
    pair.wait(["branch"])
    assert cache.stats.cached_tokens - before == len(prompts[1]) + 3 - 1  # the match, less its last position
    return held


def _spec_turns(path: str, spec, cache: bool, transfer: str | None = None):
    """(prompts, answers, accepted, drafted) of three chat turns with a draft head, in process or over gRPC."""
    from tests.test_eagle import chat_prompts

    first = chat_prompts(path, 1)[0]
    if transfer is None:
        pair = Pair(path, overlap=True, spec=spec, prefix_cache=cache)
        params = SamplingParams(max_new_tokens=N, ignore_eos=True)
        try:
            prompts = _turns(
                lambda rid, p: pair.submit(rid, p, params),
                lambda rid: pair.wait([rid]),
                lambda rid: pair.out.tokens[rid],
                first=first,
            )
            answers, (accepted, drafted) = dict(pair.out.tokens), pair.scheduler.spec_stats
            if cache:
                held = _head_kv_read(pair, prompts, answers)
        finally:
            pair.close()
        for prompt, kv in held.items() if cache else ():
            full = _full_prefill(path, spec, list(prompt))
            for got, want in zip(kv, (full.draft_k[0], full.draft_v[0])):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return prompts, answers, accepted, drafted
    flags = dict(
        speculative_algorithm=spec.algorithm,
        speculative_draft_model_path=spec.draft_model_path,
        speculative_num_steps=spec.num_steps,
        speculative_eagle_topk=spec.eagle_topk,
        speculative_num_draft_tokens=spec.num_draft_tokens,
    )
    decode_kw = dict(flags, disaggregation_decode_enable_radix_cache=cache)
    pair = GrpcPair(path, transfer=transfer, prefill_kw=dict(flags, max_chunk_bytes=4096), decode_kw=decode_kw)
    answers, stats = {}, [0, 0]

    def submit(rid, p):
        answers[rid], complete = pair.collect(pair.generate(p, N, ignore_eos=True, rid=rid))
        stats[0] += complete.spec_accepted_tokens
        stats[1] += complete.spec_draft_tokens

    try:
        prompts = _turns(submit, lambda rid: None, lambda rid: answers[rid], first=first)
    finally:
        pair.close()
    return prompts, answers, *stats


@pytest.mark.parametrize(
    "algorithm,shape,transfer",
    [
        ("EAGLE", "chain", None),
        ("EAGLE3", "tree", None),
        ("NEXTN", "chain", None),
        ("EAGLE", "chain", "grpc"),
        ("EAGLE3", "tree", "shm"),
    ],
)
def test_follow_up_turns_with_a_draft_head_keep_its_kv_and_its_accept_rate(
    checkpoint, fitted_head, algorithm, shape, transfer
):
    """With EAGLE / EAGLE3 (chain and tree) and DeepSeek's MTP layer the cache keeps the head's KV beside
    the target's (the same slots) and the delta handoff brings the head's KV of the new positions only:
    every turn matches HF, and the drafts accepted are those of the same turns without the cache (a head
    KV that was stale or landed at the wrong positions could change them); in process, the head's KV
    decode holds equals a full prefill's (decode's draft extend wrote the answers' positions)."""
    from common.engine.draft_runner import SpecArgs

    mtp = algorithm == "NEXTN"  # the MTP checkpoint's own (random) layer drafts: few accepted
    path = checkpoint("deepseek-v3-mtp" if mtp else "llama")
    head = None if mtp else fitted_head("llama", algorithm)
    spec = SpecArgs(algorithm, head, 3, *((1, 4) if shape == "chain" else (2, 6)))
    (prompts, plain, acc0, drafted0), (prompts_c, cached, acc1, drafted1) = (
        _spec_turns(path, spec, cache, transfer) for cache in (False, True)
    )
    assert prompts == prompts_c and plain == cached
    for t, p in enumerate(prompts):
        assert cached[f"t{t}"] == hf_greedy(path, p, N), t
    assert (acc0 > 0 or mtp) and abs(acc1 - acc0) <= 0.1 * acc0 + 1, ((acc0, drafted0), (acc1, drafted1))


def test_a_constrained_follow_up_turn_from_decodes_cache_matches_hf(checkpoint):
    """A grammar on the follow-up turn (its mask reads the output only, the cached KV the prompt):
    HF's greedy under xgrammar's own processor, for a regex and a JSON schema, with decode's cache hit."""
    from tests.test_grammar import CONSTRAINTS, hf_constrained

    path = checkpoint("llama")
    pair = Pair(path, prefix_cache=True)
    try:
        pair.submit("a", FIRST, SamplingParams(max_new_tokens=N, ignore_eos=True))
        pair.wait(["a"])
        follow = FIRST + pair.out.tokens["a"] + [3, 4]
        picked = [c for c in CONSTRAINTS if c[0] in ("regex", "json_schema")]
        for i, (field, text) in enumerate(picked):
            pair.submit(f"g{i}", follow, SamplingParams(max_new_tokens=16, **{field: text}))
        pair.wait([f"g{i}" for i in range(len(picked))])
        hits = pair.scheduler.books.cache.stats.cached_tokens
    finally:
        pair.close()
    assert hits == len(picked) * (len(FIRST) + N - 1)
    for i, constraint in enumerate(picked):
        assert pair.out.tokens[f"g{i}"] == hf_constrained(path, follow, constraint, 16), constraint
