"""Grammars under tensor parallelism (issue 43): every rank samples the same tokens from the gathered
logits, so every rank keeps its own matchers (seeded and released with the rows it is sent) and masks
alike; prefill's ranks mask the first token alike. Greedy output token-exact against HF with
xgrammar's HF processor over TP 2 pairs, plain and with EAGLE (a follower that did not mask would
feed its shard a different token and every rank's next logits would change)."""

from __future__ import annotations

import pytest

from common.tools.eagle_checkpoint import build as build_head
from tests.grpc_harness import GrpcPair
from tests.planted_drafts import PlantChain
from tests.test_grammar import CONSTRAINTS, PROMPTS, N, hf_constrained
from tests.test_grammar_eagle import spec_flags


@pytest.fixture(scope="module")
def want(checkpoint):
    path = checkpoint("llama")
    return path, [hf_constrained(path, p, c) for p, c in zip(PROMPTS, CONSTRAINTS)]


def _check(pair: GrpcPair, want: list) -> None:
    for i, (p, (field, text)) in enumerate(zip(PROMPTS, CONSTRAINTS)):
        ids, complete = pair.collect(pair.generate(p, N, rid=str(i), **{field: text}))
        assert ids == want[i], field
        assert complete.finish_reason == ("stop" if want[i][-1] in (2, 4) or len(want[i]) < N else "length"), field


def test_grammars_over_tp_2_pairs_match_hf(want):
    path, expected = want
    pair = GrpcPair(
        path,
        overlap=True,
        prefill_kw=dict(tp_size=2, linear_layout="mkl"),
        decode_kw=dict(tp_size=2, linear_layout="mkl"),
    )
    try:
        _check(pair, expected)
    finally:
        pair.close()
    pair.prefill.worker.check_idle_integrity()


def test_grammars_under_eagle_over_a_tp_2_decode_match_hf(want, tmp_path):
    """Every rank drafts, masks and verifies alike: drafts planted from the oracle on every rank
    (decode_service/hooks.py, through the spawn pipe) are accepted deep into each run, so a follower
    that masked from the wrong state (or not at all) would feed its shard another token."""
    path, expected = want
    spec = spec_flags(build_head(path, "EAGLE", str(tmp_path)), 1)
    plant = PlantChain({str(i): w for i, w in enumerate(expected)})
    pair = GrpcPair(
        path,
        prefill_kw=dict(linear_layout="mkl", **spec),
        decode_kw=dict(tp_size=2, **spec),
        decode_hooks=plant,
    )
    try:
        _check(pair, expected)
        accepted, drafted = pair.decode.scheduler.spec_stats
        assert accepted >= 0.5 * drafted, (accepted, drafted)
    finally:
        pair.close()
