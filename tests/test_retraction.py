"""Retraction is exact (issue 55): requests retracted at chosen steps (DecodeHooks.retract names them,
as if the decode pool had run dry) come back re-prefilled from prompt + the outputs already sent and
finish with exactly the tokens HF `generate` gives (greedy), or the tokens and logprobs the same
requests get without retraction (sampled, penalties, logprobs, grammars, n > 1); over gRPC, shm and
Mooncake as well as in process; every slot freed once (the harnesses check the pools on close)."""

from __future__ import annotations

import math

import pytest

from common.engine.draft_runner import SpecArgs
from common.engine.sampling import SamplingParams
from common.tools.eagle_checkpoint import build as build_head
from decode_service.hooks import DecodeHooks
from tests.decode_harness import Hooks, Pair
from tests.grpc_harness import GrpcPair, needs_mooncake
from tests.oracle import hf_greedy

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


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_retracted_requests_under_eagle_match_hf(checkpoint, tmp_path, tree):
    path = checkpoint("llama")
    head = build_head(path, "EAGLE", str(tmp_path / "head"))
    spec = SpecArgs("EAGLE", head, 3, 2, 6) if tree else SpecArgs("EAGLE", head, 3, 1, 4)
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


def test_retracted_samples_of_n_match_the_unretracted_run(checkpoint):
    path = checkpoint("llama")
    params = [SamplingParams(max_new_tokens=N, temperature=0.8, seed=11, n=3, ignore_eos=True)]
    want, got = _run(path, params, retract=False), _run(path, params, retract=True)
    assert got.out.tokens == want.out.tokens and set(got.out.tokens) == {"0", "0/1", "0/2"}


@pytest.mark.parametrize("transfer", ["grpc", "shm", pytest.param("mooncake", marks=needs_mooncake)])
def test_retraction_over_the_wire_matches_hf(checkpoint, transfer):
    """The re-prefill goes through the prefill client as a retry would (its outputs as tokens already
    sent) and lands its KV through the transport into the request's new slots."""
    path = checkpoint("llama")
    hooks = RetractAt({(str(i), s) for i in range(3) for s in (3, 8)})
    pair = GrpcPair(path, transfer=transfer, decode_kw=dict(decode_kv_grow_tokens=3), decode_hooks=hooks)
    try:
        calls = [pair.generate(PROMPTS[i], N, ignore_eos=True, rid=str(i)) for i in range(3)]
        outs = [pair.collect(c)[0] for c in calls]
    finally:
        pair.close()
    assert len(hooks.done) >= 3, hooks.done
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
