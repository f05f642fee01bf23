"""The experts' Triton grouped GEMM (common/models/triton_moe.py) against the torch loop
(common/models/moe.py's run_experts), on CPU under Triton's interpreter (set in conftest.py): uneven
loads with idle experts, one expert holding several tiles, batch 1, hidden and intermediate sizes that
are not powers of two, strided weights, expert parallelism's pairs left out; the tile schedule's
invariants; and a whole Qwen3-MoE model served with the Triton experts, token-exact with HF."""

import os

import pytest
import torch

from common.models import moe, triton_moe

pytest.importorskip("triton", reason="the triton package is a dev dependency (.ci/setup installs it)")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU runs need TRITON_INTERPRET=1 before triton loads (tests/conftest.py sets it)",
)


def _weights(experts, hidden, inter, g):
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return gate_up, down


def _routing(tokens, k, experts, g, skew):
    """ids [T, k] (distinct per token) and weights [T, k]; `skew`: choices drawn from the first
    experts mostly, so the rest get few tokens or none."""
    probs = torch.tensor([skew**-e for e in range(experts)], dtype=torch.float64)
    ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(tokens)])
    return ids, torch.rand(tokens, k, generator=g)


CASES = [  # (tokens, k, experts, hidden, inter, skew)
    (1, 2, 8, 64, 32, 1.0),  # batch 1: two tiles, six idle experts
    (7, 2, 8, 64, 32, 1.0),
    (40, 3, 8, 48, 40, 3.0),  # skewed: expert 0 holds several tiles, the last experts none
    (33, 1, 4, 80, 24, 8.0),  # top-1, nearly every token on one expert
    (100, 8, 16, 64, 96, 1.5),  # tiles of 64 rows
]


@pytest.mark.parametrize("tokens,k,experts,hidden,inter,skew", CASES)
def test_grouped_gemm_matches_the_torch_loop(tokens, k, experts, hidden, inter, skew):
    g = torch.Generator().manual_seed(tokens)
    gate_up, down = _weights(experts, hidden, inter, g)
    x = torch.randn(tokens, hidden, generator=g)
    ids, weights = _routing(tokens, k, experts, g, skew)
    if skew >= 3:
        assert torch.bincount(ids.reshape(-1), minlength=experts).min() == 0, "the case wants an idle expert"
    got = triton_moe.run_experts(x, ids, weights, gate_up, down)
    torch.testing.assert_close(got, moe.run_experts(x, ids, weights, gate_up, down), atol=1e-4, rtol=1e-4)


def test_strided_weights_and_expert_parallel_pairs_left_out():
    """A rank holding experts [4, 8) of 8 (expert parallelism): pairs routed to experts 0-3 are left
    out (a token with none of its experts here gets zeros); the down weight a strided view."""
    g = torch.Generator().manual_seed(3)
    gate_up, _ = _weights(4, 64, 32, g)
    down = _weights(4, 64, 64, g)[1][:, :, ::2]  # [4, 64, 32], stride 2 along the intermediate
    x = torch.randn(21, 64, generator=g)
    ids, weights = _routing(21, 2, 8, g, 1.0)
    ids[0] = torch.tensor([0, 1])  # nothing for this rank
    got = triton_moe.run_experts(x, ids, weights, gate_up, down, first_expert=4)
    want = moe.run_experts(x, ids, weights, gate_up, down.contiguous(), first_expert=4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[0], torch.zeros(64))


@pytest.mark.parametrize("block", [16, 64])
def test_tiles_cover_every_kept_row_once_inside_one_expert(block):
    g = torch.Generator().manual_seed(block)
    experts = 8
    for pairs in (1, 5, 16, 17, 130, 600):
        ids = torch.randint(0, experts + 1, (pairs,), generator=g)  # experts here, and E for pairs left out
        ids[torch.rand(pairs, generator=g) < 0.5] = 0  # one heavy expert
        sorted_ids = ids.sort().values
        tile_e, first, end = triton_moe.tile_schedule(sorted_ids, experts, block)
        assert tile_e.numel() == triton_moe.max_tiles(pairs, experts, block)
        covered = torch.zeros(pairs, dtype=torch.int64)
        for e, f, n in zip(tile_e.tolist(), first.tolist(), end.tolist()):
            if f >= n:
                continue  # a tile past the real ones
            rows = torch.arange(f, min(f + block, n))
            assert torch.all(sorted_ids[rows] == e), "a tile crossed an expert's boundary"
            assert n == int((sorted_ids <= e).sum()), "the end is the expert's last row + 1"
            covered[rows] += 1
        assert torch.equal(covered, (sorted_ids < experts).long()), f"pairs={pairs}"


def test_bound_holds_for_the_worst_split():
    """Every expert with rows one past a tile: the most tiles for P rows, which the bound must hold."""
    block, experts = 16, 8
    sorted_ids = torch.arange(experts).repeat_interleave(block + 1)
    tile_e, first, end = triton_moe.tile_schedule(sorted_ids, experts, block)
    assert int((first < end).sum()) == 2 * experts <= tile_e.numel()


def test_qwen3_moe_through_triton_matches_hf_greedy(checkpoint, monkeypatch):
    """The runner's switch: `--attention-backend triton` routes every sparse layer through the grouped
    GEMM; a chunked prefill and decode steps give HF's greedy tokens."""
    from common.engine.colocated import ColocatedLoop
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.engine.sampling import SamplingParams
    from tests.oracle import hf_greedy

    calls = []
    kernel = triton_moe.run_experts
    monkeypatch.setattr(triton_moe, "run_experts", lambda *a: calls.append(1) or kernel(*a))
    path = checkpoint("qwen3-moe")
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=4, attention_backend="triton"))
    sparse = [m for m in runner.model.modules() if isinstance(m, moe.SparseMoE)]
    assert sparse and all(m.experts_kernel is not None for m in sparse)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 11)]
    reqs = ColocatedLoop(runner, chunk_size=8).generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    for prompt, req in zip(prompts, reqs):
        assert req.output == hf_greedy(path, prompt, 4), f"prompt of length {len(prompt)}"
    assert calls, "the Triton experts ran"
