"""The EAGLE tree's bookkeeping as batched tensor ops (decode_service/eagle_tree_step.py) against a
per-node walk, and the sampler's top-k-only sort (common/engine/sampling.py) against a full sort."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine import sampling, spec_sampling
from common.engine.sampling import SamplingParams, keep_sorted, sample, uniform
from decode_service.eagle_tree_step import ancestors, reached


def _random_trees(batch: int, m: int, max_depth: int, seed: int) -> torch.Tensor:
    """parent [B, M], parents first (node i's parent < i), depth at most max_depth, root is its own parent."""
    rng = random.Random(seed)
    parent = torch.zeros(batch, m, dtype=torch.int64)
    for b in range(batch):
        depth = [0]
        for i in range(1, m):
            parent[b, i] = rng.choice([j for j in range(i) if depth[j] < max_depth])
            depth.append(depth[parent[b, i]] + 1)
    return parent


def _walk_ancestors(parent: torch.Tensor) -> torch.Tensor:
    batch, m = parent.shape
    anc = torch.zeros(batch, m, m, dtype=torch.bool)
    for b in range(batch):
        for i in range(m):
            j = i
            anc[b, i, j] = True
            while j:
                j = int(parent[b, j])
                anc[b, i, j] = True
    return anc


@pytest.mark.parametrize("m,max_depth", [(1, 1), (4, 1), (8, 3), (16, 5), (24, 7)])
def test_ancestor_mask_and_greedy_reach_equal_a_walk_per_node(m, max_depth):
    parent = _random_trees(6, m, max_depth, seed=m)
    anc = ancestors(parent, max_depth)
    assert torch.equal(anc, _walk_ancestors(parent))
    gen = torch.Generator().manual_seed(m)
    tokens = torch.randint(0, 3, (6, m), generator=gen)  # few ids: many matches and mismatches
    target = torch.randint(0, 3, (6, m), generator=gen)
    want = torch.zeros(6, m, dtype=torch.bool)
    for b in range(6):
        want[b, 0] = True
        for i in range(1, m):
            p = int(parent[b, i])
            want[b, i] = bool(want[b, p]) and int(tokens[b, i]) == int(target[b, p])
    assert torch.equal(reached(tokens, parent, anc, target), want)


def test_too_few_levels_miss_deep_ancestors():
    """The level count matters: a chain of depth 5 walked 2 levels up loses its root link (the test
    above fails if ancestors() stops early)."""
    parent = torch.tensor([[0, 0, 1, 2, 3, 4]])
    assert not ancestors(parent, 2)[0, 5, 0] and ancestors(parent, 5)[0, 5, 0]


def test_top_k_rows_sort_only_their_candidates_and_draw_what_a_full_sort_draws(monkeypatch):
    vocab = 300
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1)) * 2
    params = [
        SamplingParams(temperature=0.8, top_k=k, top_p=0.9, min_p=0.02, seed=i) for i, k in enumerate((1, 5, 20, 40, 7))
    ]
    seeds, positions = [p.resolved_seed() for p in params], [0, 3, 1, 8, 2]
    # reference: the whole vocabulary sorted, as before
    probs = torch.softmax(logits / 0.8, dim=-1)
    sp, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = keep_sorted(sp, torch.tensor([[p.top_k] for p in params]), torch.full((5, 1), 0.9), torch.full((5, 1), 0.02))
    cdf = torch.cumsum(torch.where(keep, sp, 0.0), -1)
    u = torch.tensor([uniform(s, pos) for s, pos in zip(seeds, positions)])
    pick = torch.minimum(torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True), keep.sum(-1, keepdim=True) - 1)
    want = order.gather(1, pick).squeeze(1)

    def no_full_sort(*args, **kwargs):
        raise AssertionError("a batch whose rows all have a top-k sorts only the top-k")

    monkeypatch.setattr(sampling.torch, "sort", no_full_sort)
    assert torch.equal(sample(logits, params, seeds, positions), want)
    kept = spec_sampling.filtered_probs(
        logits, torch.full((5, 1), 0.8), torch.tensor([[p.top_k] for p in params]), torch.full((5, 1), 0.9),
        torch.full((5, 1), 0.02), width=40,
    )  # fmt: skip
    monkeypatch.undo()
    full = spec_sampling.filtered_probs(
        logits, torch.full((5, 1), 0.8), torch.tensor([[p.top_k] for p in params]), torch.full((5, 1), 0.9),
        torch.full((5, 1), 0.02),
    )  # fmt: skip
    assert torch.allclose(kept, full, atol=1e-7) and ((kept > 0).sum(-1) <= torch.tensor([1, 5, 20, 40, 7])).all()


def test_a_row_without_top_k_sorts_the_whole_vocabulary():
    assert (
        sampling.topk_width([SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_p=0.5)])
        is None
    )
    assert (
        sampling.topk_width([SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_k=9)]) == 9
    )
    probs = torch.softmax(torch.randn(2, 50), -1)
    full, _ = sampling.sorted_candidates(probs, None)
    assert full.shape == (2, 50) and torch.equal(sampling.sorted_candidates(probs, 50)[0], full)
    assert torch.equal(sampling.sorted_candidates(probs, 4)[0], full[:, :4])
