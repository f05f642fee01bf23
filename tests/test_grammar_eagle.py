"""Grammars under EAGLE (issue 43, part 4): each draft node of a chain or a tree is masked by the
grammar state along its own path, the matcher advances by the committed run (accepted drafts and
the bonus). Greedy output token-exact against HF generate with xgrammar's HF processor, chain and
tree, overlap on and off, in-process and over gRPC; drafts planted from the oracle are accepted
deep into the run (a mask from the wrong state would change the target there), and drafts planted
from the unconstrained argmax are refused (a missing mask would accept them); sampled chains stay
inside the grammar and repeat with overlap on and off."""

from __future__ import annotations

import pytest
import torch

from common.engine import grammar
from common.engine.draft_runner import SpecArgs
from common.tools.eagle_checkpoint import build as build_head
from tests.decode_harness import Hooks, Pair
from tests.oracle import hf_model
from tests.planted_drafts import PlantChain, PlantTree
from tests.test_grammar import CONSTRAINTS, PROMPTS, N, compiler, hf_constrained, params_of

STEPS = 3


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    path = checkpoint("llama")
    head = build_head(path, "EAGLE", str(tmp_path_factory.mktemp("head")))
    want = {str(i): hf_constrained(path, p, c) for i, (p, c) in enumerate(zip(PROMPTS, CONSTRAINTS))}
    return path, head, want


def _spec(head: str, topk: int = 1) -> SpecArgs:
    return SpecArgs("EAGLE", head, STEPS, topk, STEPS + 1 if topk == 1 else 6)


def _run(pair: Pair, **kw) -> dict:
    for i, (p, c) in enumerate(zip(PROMPTS, CONSTRAINTS)):
        pair.submit(str(i), p, params_of(c, **kw))
    pair.wait([str(i) for i in range(len(PROMPTS))])
    return pair.out.tokens


def _planted(refs: dict, topk: int) -> Hooks:
    """In-process hooks planting `refs` (tests/planted_drafts.py) as a chain (topk 1) or a tree."""
    return Hooks(propose=PlantChain(refs).propose) if topk == 1 else Hooks(propose_tree=PlantTree(refs).propose_tree)


def _check(pair: Pair, want: dict) -> None:
    for rid, w in want.items():
        assert pair.out.tokens[rid] == w, CONSTRAINTS[int(rid)][0]
        ended = w[-1] in (2, 4) or len(w) < N
        assert pair.out.reasons[rid] == ("stop" if ended else "length"), rid


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
@pytest.mark.parametrize("overlap", [True, False])
def test_oracle_drafts_are_accepted_deep_into_each_run(setup, topk, overlap):
    """Every node on the planted path is the grammar's own greedy choice: all of them commit, so the
    masks at depth 1..S come from the state after the path's tokens (not node 0's)."""
    path, head, want = setup
    pair = Pair(path, overlap=overlap, spec=_spec(head, topk), hooks=_planted(want, topk))
    _run(pair)
    _check(pair, want)
    accepted, drafted = pair.scheduler.spec_stats
    assert accepted >= 0.5 * drafted, (accepted, drafted)  # random drafts: about 1 in 70 accepted
    pair.close()


@torch.inference_mode()
def _unmasked_choices(path: str, want: dict) -> dict:
    """rid -> the oracle's output with, at each position, the unconstrained argmax there whenever the
    grammar refuses it (else the oracle's token): what the target picks where a mask is missing."""
    model, c = hf_model(path), compiler(path)
    out = {}
    for rid, w in want.items():
        prompt, compiled = PROMPTS[int(rid)], c.compile(CONSTRAINTS[int(rid)])
        logits = model(torch.tensor([prompt + w])).logits[0, len(prompt) - 1 :]
        free = logits.argmax(-1).tolist()
        plant = []
        for k, token in enumerate(w):
            m = grammar.new_matcher(compiled, w[:k])
            plant.append(free[k] if not m.accept_token(free[k]) else token)
        out[rid] = plant
    return out


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_drafts_the_grammar_refuses_are_never_accepted(setup, topk):
    """Drafts planted from the unconstrained argmax where the grammar refuses it: an unmasked verify
    would take them (they are the target's own choice), a masked one never does."""
    path, head, want = setup
    plant = _unmasked_choices(path, want)
    refused = sum(p != w for rid, w in want.items() for p, w in zip(plant[rid], w))
    assert refused >= 5, "the oracle never departs from the unconstrained argmax: nothing to refuse"
    hook = _planted(plant, topk)
    pair = Pair(path, overlap=True, spec=_spec(head, topk), hooks=hook)
    _run(pair)
    _check(pair, want)
    pair.close()


def test_random_head_drafts_under_a_grammar_match_hf(setup):
    """The head's own drafts (mostly refused by the target or the grammar): exact, tree too."""
    path, head, want = setup
    for topk in (1, 2):
        pair = Pair(path, overlap=True, spec=_spec(head, topk))
        _run(pair)
        _check(pair, want)
        pair.close()


def test_sampled_chains_stay_inside_the_grammar_and_repeat(setup):
    path, head, want = setup
    outs = []
    for overlap in (True, False):
        pair = Pair(path, overlap=overlap, spec=_spec(head), hooks=_planted(want, 1))
        outs.append(dict(_run(pair, temperature=1.0, seed=11)))
        pair.close()
    assert outs[0] == outs[1]
    c = compiler(path)
    for rid, tokens in outs[0].items():
        grammar.new_matcher(c.compile(CONSTRAINTS[int(rid)]), tokens)  # raises on a refused token
    assert any(outs[0][rid] != want[rid] for rid in want), "sampling gave the greedy output everywhere"


def spec_flags(head: str, topk: int) -> dict:
    """The services' EAGLE flags for `_spec(head, topk)`."""
    spec = _spec(head, topk)
    return dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=head,
        speculative_num_steps=spec.num_steps,
        speculative_eagle_topk=spec.eagle_topk,
        speculative_num_draft_tokens=spec.num_draft_tokens,
    )


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_grammars_under_eagle_over_grpc_match_hf(setup, topk):
    """Prefill masks the first token and ships the draft seed; decode verifies masked drafts planted from
    the oracle (decode_service/hooks.py), so they are accepted deep into each run: a verify mask taken
    from the wrong node's state would change the target there."""
    from tests.grpc_harness import GrpcPair

    path, head, want = setup
    flags = spec_flags(head, topk)
    plant = PlantChain(want) if topk == 1 else PlantTree(want)
    pair = GrpcPair(path, prefill_kw=flags, decode_kw=flags, decode_hooks=plant)
    try:
        for i, (p, c) in enumerate(zip(PROMPTS, CONSTRAINTS)):
            ids, complete = pair.collect(pair.generate(p, N, rid=str(i), **{c[0]: c[1]}))
            assert ids == want[str(i)], c[0]
        accepted, drafted = pair.decode.scheduler.spec_stats
        assert accepted >= 0.5 * drafted, (accepted, drafted)
    finally:
        pair.close()
