"""Retraction is exact (issue 55): requests retracted at chosen steps (DecodeHooks.retract names them,
as if the decode pool had run dry) come back re-prefilled from prompt + the outputs already sent and
finish with exactly the tokens HF `generate` gives (greedy), or the tokens and logprobs the same
requests get without retraction (sampled, penalties, logprobs, grammars, n > 1); over gRPC, shm and
Mooncake as well as in process; every slot freed once (the harnesses check the pools on close)."""

from __future__ import annotations

import math
import time

import pytest

from common.engine.draft_runner import SpecArgs
from common.engine.sampling import SamplingParams
from common.tools.eagle_checkpoint import build as build_head
from decode_service.hooks import DecodeHooks
from decode_service.req import ReqState
from tests.decode_harness import Hooks, Pair
from tests.grpc_harness import GrpcPair, needs_mooncake
from tests.oracle import hf_greedy
from tests.test_metrics import _scrape

N = 14
PROMPTS = [[5, 9, 14, 3, 22, 8], [31, 7, 2, 40, 11], [17, 17, 4, 29, 6, 12, 3, 8]]
AT = {("0", 3), ("1", 5), ("0", 9), ("2", 7), ("0/1", 4), ("0/2", 6)}  # (request or sample, step)


class RetractAt(DecodeHooks):
    """Retract each (rid, step) of `at` once, before that step launches."""

    def __init__(self, at=AT):
        self.at, self.done = set(at), []

    def retract(self, step, reqs):
        hit = [r for r in reqs if (r.rid.split("#")[0], step) in self.at]
        self.at -= {(r.rid.split("#")[0], step) for r in hit}
        self.done += [r.rid for r in hit]
        return hit


def _run(path: str, params: list[SamplingParams], retract: bool, overlap: bool = True, **kw) -> Pair:
    """The requests with the full reservation, or (retract) on demand, grown 3 slots at a time (each row
    extended every few steps), with the retractions of AT."""
    hooks = RetractAt() if retract else None
    growth = dict(kv_reservation="on-demand", kv_grow_tokens=3) if retract else dict(kv_reservation="full")
    pair = Pair(path, overlap=overlap, hooks=Hooks(retract=hooks.retract) if hooks else None, **growth, **kw)
    try:
        for i, p in enumerate(params):
            pair.submit(str(i), PROMPTS[i], p)
        rids = [str(i) for i in range(len(params))]
        rids += [f"{i}/{j}" for i, p in enumerate(params) for j in range(1, p.n)]
        pair.wait(rids)
    finally:
        pair.close()  # integrity: every slot freed once
    if retract:
        assert pair.scheduler.growth.retractions >= 3 and len(hooks.done) >= 3, hooks.done
    return pair


@pytest.mark.parametrize("overlap", [True, False])
def test_retracted_greedy_requests_match_hf(checkpoint, overlap):
    path = checkpoint("llama")
    pair = _run(path, [SamplingParams(max_new_tokens=N, ignore_eos=True)] * 3, retract=True, overlap=overlap)
    for i in range(3):
        assert pair.out.tokens[str(i)] == hf_greedy(path, PROMPTS[i], N), i


@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek-v3"])
def test_retracted_requests_of_moe_and_mla_models_match_hf(checkpoint, name):
    path = checkpoint(name)
    pair = _run(path, [SamplingParams(max_new_tokens=N, ignore_eos=True)] * 3, retract=True)
    for i in range(3):
        assert pair.out.tokens[str(i)] == hf_greedy(path, PROMPTS[i], N), i


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_retracted_requests_under_eagle_match_hf(checkpoint, tmp_path, tree, algorithm):
    path = checkpoint("llama")
    head = build_head(path, algorithm, str(tmp_path / "head"))
    spec = SpecArgs(algorithm, head, 3, 2, 6) if tree else SpecArgs(algorithm, head, 3, 1, 4)
    pair = _run(path, [SamplingParams(max_new_tokens=N, ignore_eos=True)] * 3, retract=True, spec=spec)
    for i in range(3):
        assert pair.out.tokens[str(i)] == hf_greedy(path, PROMPTS[i], N), i


def test_sampling_penalties_logprobs_and_grammars_are_unchanged_by_retraction(checkpoint):
    path = checkpoint("llama")
    params = [
        SamplingParams(max_new_tokens=N, temperature=0.8, seed=7, frequency_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(max_new_tokens=N, ignore_eos=True, return_logprob=True, top_logprobs_num=3),
        SamplingParams(max_new_tokens=N, temperature=0.9, seed=3, regex="(ab|cd)+[0-9]{2,6}e"),
    ]
    want, got = _run(path, params, retract=False), _run(path, params, retract=True)
    assert got.out.tokens == want.out.tokens and got.out.reasons == want.out.reasons
    for a, b in zip(want.out.logprobs["1"], got.out.logprobs["1"]):  # a re-prefilled first token: prefill's
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_retracted_samples_of_n_match_the_unretracted_run(checkpoint, temperature):
    path = checkpoint("llama")
    params = [SamplingParams(max_new_tokens=N, temperature=temperature, seed=11, n=3, ignore_eos=True)]
    want, got = _run(path, params, retract=False), _run(path, params, retract=True)
    assert got.out.tokens == want.out.tokens and set(got.out.tokens) == {"0", "0/1", "0/2"}
    if not temperature:  # greedy twins: every sample is HF's greedy answer
        assert all(t == hf_greedy(path, PROMPTS[0], N) for t in got.out.tokens.values())


def test_a_small_pool_under_load_with_aborts_retracts_and_frees_every_slot_once(checkpoint):
    """Eight requests in a pool that holds about three answers, grown 4 slots at a time: the pool runs
    dry and requests are retracted by the rule (no hook); two are aborted mid-answer. The others match
    HF, and closing checks every slot came back once."""
    path = checkpoint("llama")
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + i % 3)] for i in range(8)]
    pair = Pair(path, kv_reservation="on-demand", kv_grow_tokens=4, decode_tokens=3 * (8 + 24), decode_reqs=8)
    try:
        for i, p in enumerate(prompts):
            pair.submit(str(i), p, SamplingParams(max_new_tokens=24, ignore_eos=True))
        pair.wait_tokens("2", 3)
        pair.scheduler.abort("2")
        pair.wait_tokens("5", 1)
        pair.scheduler.abort("5")
        pair.wait([str(i) for i in range(8)])
    finally:
        pair.close()
    assert pair.scheduler.growth.retractions > 0
    for i in range(8):
        if i in (2, 5):
            assert pair.out.reasons[str(i)] == "abort"
            continue
        assert pair.out.tokens[str(i)] == hf_greedy(path, prompts[i], 24), i


@pytest.mark.parametrize("transfer", ["grpc", "shm", pytest.param("mooncake", marks=needs_mooncake)])
def test_retraction_over_the_wire_matches_hf(checkpoint, transfer):
    """The re-prefill goes through the prefill client as a retry would (its outputs as tokens already
    sent) and lands its KV through the transport into the request's new slots."""
    path = checkpoint("llama")
    hooks = RetractAt({(str(i), s) for i in range(3) for s in (3, 8)})
    decode_kw = dict(decode_kv_grow_tokens=3, metrics_port=0)
    pair = GrpcPair(path, transfer=transfer, decode_kw=decode_kw, decode_hooks=hooks)
    try:
        calls = [pair.generate(PROMPTS[i], N, ignore_eos=True, rid=str(i)) for i in range(3)]
        outs = [pair.collect(c)[0] for c in calls]
        metrics = _scrape(pair.decode.metrics_port)
    finally:
        pair.close()
    assert len(hooks.done) >= 3, hooks.done
    assert metrics["disagg_retractions_total"] == len(hooks.done) and metrics["disagg_reprefilled_tokens_total"] > 0
    for i in range(3):
        assert outs[i] == hf_greedy(path, PROMPTS[i], N), i


def test_retraction_over_tp_2_pairs_matches_hf(checkpoint):
    """Every decode rank maps the grown slots (ExtendRow, in rank 0's stream order) and drops a retracted
    row; the re-prefill lands on every rank's heads."""
    path = checkpoint("llama")
    hooks = RetractAt({(str(i), s) for i in range(3) for s in (4, 9)})
    pair = GrpcPair(
        path,
        prefill_kw=dict(tp_size=2, linear_layout="mkl"),
        decode_kw=dict(tp_size=2, linear_layout="mkl", decode_kv_grow_tokens=3),
        decode_hooks=hooks,
    )
    try:
        calls = [pair.generate(PROMPTS[i], N, ignore_eos=True, rid=str(i)) for i in range(3)]
        outs = [pair.collect(c)[0] for c in calls]
    finally:
        pair.close()
    assert len(hooks.done) >= 3, hooks.done
    for i in range(3):
        assert outs[i] == hf_greedy(path, PROMPTS[i], N), i


def test_stop_strings_after_retraction_match_the_unretracted_run(checkpoint):
    """Stop strings are matched on decode over the whole output, re-prefilled part included: a stop
    string first completed after both retractions ends the retracted run where it ends the other."""
    from transformers import AutoTokenizer

    path = checkpoint("llama")
    greedy = hf_greedy(path, PROMPTS[0], 40)
    tok = AutoTokenizer.from_pretrained(path)
    text = [tok.decode(greedy[:k]) for k in range(41)]
    k = next(k for k in range(12, 40) if len(text[k]) >= 3 and text[k][-3:] not in text[k - 1])
    stop = text[k][-3:]  # completed first by token k (0-based k - 1), after the retractions at steps 3 and 6
    runs, retracting = [], RetractAt({("0", 3), ("0", 6)})
    for hooks in (None, retracting):
        pair = GrpcPair(path, decode_kw=dict(decode_kv_grow_tokens=3), decode_hooks=hooks)
        try:
            runs.append(pair.collect(pair.generate(PROMPTS[0], 40, rid="0", stop=[stop], ignore_eos=True)))
        finally:
            pair.close()
    (want, want_done), (got, got_done) = runs
    assert got == want and got_done.finish_reason == want_done.finish_reason == "stop"
    assert got_done.matched_stop_str == want_done.matched_stop_str == stop
    assert len(retracting.done) == 2 and len(got) > 6, retracting.done


def test_a_retracted_request_aborted_while_its_kv_streams_in_frees_its_slots_once(checkpoint):
    """The re-prefill writes into the request's new slots through shared memory while it is aborted:
    the slots stay reserved until prefill's last word on them, then come back once."""
    from prefill_service.hooks import Delays

    path = checkpoint("llama")
    hooks = RetractAt({("0", 3)})
    pair = GrpcPair(
        path,
        transfer="shm",
        prefill_kw=dict(max_chunk_bytes=512),
        prefill_hooks=Delays(kv_message_s=0.05),
        decode_kw=dict(decode_kv_grow_tokens=3),
        decode_hooks=hooks,
    )
    sched = pair.decode.scheduler
    try:
        call = pair.generate(PROMPTS[0] * 4, 30, stream=True, rid="0", ignore_eos=True)
        next(call)
        deadline = time.time() + 30
        while not any(r.retractions and r.state == ReqState.AWAITING_HANDOFF for r in list(sched.reqs.values())):
            assert time.time() < deadline, "the request was never re-prefilling"
            time.sleep(0.005)
        call.cancel()
    finally:
        pair.close()  # waits for idle: every slot freed once
    assert hooks.done
