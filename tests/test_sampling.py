"""Sampler: seeded reproducibility, batch independence, filters, top-k=1 == greedy."""

from __future__ import annotations

import pytest
import torch

from common.engine.colocated import ColocatedLoop
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams, sample, uniform

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_uniform_depends_only_on_seed_and_position():
    assert uniform(5, 3) == uniform(5, 3)
    values = {uniform(s, p) for s in range(20) for p in range(20)}
    assert len(values) == 400 and all(0.0 <= u < 1.0 for u in values)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = _logits(6)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, min_p=0.01, seed=i) for i in range(6)]
    seeds = [p.resolved_seed() for p in params]
    positions = [3, 0, 7, 1, 2, 9]
    batched = sample(logits, params, seeds, positions)
    assert torch.equal(batched, sample(logits, params, seeds, positions))
    for i in range(6):  # alone, and in a batch in another order with greedy neighbours
        alone = sample(logits[i : i + 1], [params[i]], [seeds[i]], [positions[i]])
        assert alone.item() == batched[i].item()
    order = [4, 0, 5, 2, 1, 3]
    mixed = sample(
        torch.cat([logits[order], _logits(2, 1)]),
        [params[i] for i in order] + [SamplingParams()] * 2,
        [seeds[i] for i in order] + [0, 0],
        [positions[i] for i in order] + [0, 0],
    )
    assert mixed[:6].tolist() == batched[order].tolist()


def test_different_seeds_or_positions_explore():
    logits = torch.zeros(1, V)  # uniform distribution: draws should spread
    p = SamplingParams(temperature=1.0)
    draws = {sample(logits, [p], [s], [0]).item() for s in range(200)}
    assert len(draws) > 30
    draws = {sample(logits, [p], [1], [n]).item() for n in range(200)}
    assert len(draws) > 30


def test_top_k_one_equals_greedy():
    logits = _logits(16, 3)
    params = [SamplingParams(temperature=t, top_k=1, seed=i) for i, t in enumerate([0.5, 1.0, 2.0, 100.0] * 4)]
    tokens = sample(logits, params, [p.seed for p in params], list(range(16)))
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p"])
def test_filters_keep_only_allowed_tokens(kind):
    logits = _logits(1, 4)
    probs = torch.softmax(logits[0], -1)
    order = torch.argsort(probs, descending=True)
    if kind == "top_k":
        params, allowed = SamplingParams(temperature=1.0, top_k=3), set(order[:3].tolist())
    elif kind == "top_p":
        cum = torch.cumsum(probs[order], 0)
        n = int((cum < 0.5).sum()) + 1
        params, allowed = SamplingParams(temperature=1.0, top_p=0.5), set(order[:n].tolist())
    else:
        params, allowed = (
            SamplingParams(temperature=1.0, min_p=0.2),
            set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist()),
        )
    seen = {sample(logits, [params], [s], [0]).item() for s in range(300)}
    assert seen <= allowed and len(seen) == len(allowed)


def test_greedy_is_argmax_and_params_validate():
    logits = _logits(4, 5)
    assert torch.equal(sample(logits, [SamplingParams()] * 4, [0] * 4, [0] * 4), logits.argmax(-1))
    for bad in [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(min_p=1.5), dict(seed=-2)]:
        field = next(iter(bad))
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad).validate(V)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(V,)).validate(V)


def test_a_temperature_below_the_floor_is_greedy_not_nan():
    """logits / 1e-45 overflow float32 (inf - inf in the softmax): such a temperature is the argmax, as
    SGLang takes any temperature below 1e-5; at the floor itself it samples."""
    from common.engine.sampling import MIN_TEMPERATURE

    logits = _logits(6, 5)
    tiny = [SamplingParams(temperature=t, seed=3) for t in (1e-45, 1e-30, 5e-6, 0.0, 9.9e-6, 1e-7)]
    assert all(p.greedy for p in tiny)
    assert torch.equal(sample(logits, tiny, [3] * 6, [0] * 6), logits.argmax(-1))
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


def test_seeded_request_same_tokens_alone_and_in_a_batch(checkpoint):
    """End to end through the colocated loop: a seeded request's tokens do not depend on its batch."""
    path = checkpoint("qwen2")
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=1024, max_running_requests=8))
    loop = ColocatedLoop(runner, chunk_size=16)
    target = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = [11, 42, 7, 99, 100]
    [alone] = loop.generate([prompt], target)
    others = [[5] * 30, [8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    batch = loop.generate(
        others[:2] + [prompt] + others[2:],
        [
            SamplingParams(max_new_tokens=25, temperature=1.0, seed=9, ignore_eos=True),
            SamplingParams(max_new_tokens=5, ignore_eos=True),
            target,
            SamplingParams(max_new_tokens=12, temperature=0.5, ignore_eos=True),
        ],
    )
    assert batch[2].output == alone.output
    different_seed = SamplingParams(**{**target.__dict__, "seed": 4321})
    assert loop.generate([prompt], different_seed)[0].output != alone.output


@pytest.mark.parametrize("filtered", [False, True])
def test_temperature_sampling_follows_the_softmax(filtered):
    """Both draw paths (unsorted for temperature only, sorted when a filter is on) sample from
    softmax(logits / T): empirical frequencies over 4000 seeds within 0.03 of it."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, 0.2, -0.5]])
    params = SamplingParams(temperature=0.7, top_p=0.99999 if filtered else 1.0)
    assert params.filtered == filtered
    n = 4000
    tokens = sample(logits.expand(n, -1).contiguous(), [params] * n, list(range(n)), [3] * n)
    freq = torch.bincount(tokens, minlength=8).float() / n
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_sampling_inputs_live_on_the_batch_not_rebuilt_per_step():
    from decode_service.req import DecodeReq, ReqState
    from decode_service.schedule_batch import ScheduleBatch

    reqs = [
        DecodeReq(
            str(i), [5, 6], SamplingParams(temperature=0.5 * i), seed=i, req_pool_idx=i + 1, state=ReqState.RUNNING
        )
        for i in range(3)
    ]
    batch = ScheduleBatch.prebuilt(reqs, [2, 2, 2], torch.device("cpu"))
    first = batch.sampling
    assert first.plain == [1, 2] and not first.all_greedy
    batch.bump()
    assert batch.sampling is first  # a step changes lengths, not membership
    reqs[0].finish_reason = "stop"
    smaller = batch.filter_unfinished()
    assert smaller.sampling is not first and smaller.sampling.plain == [0, 1]
    logits = _logits(2)
    assert torch.equal(
        smaller.sampling.sample(logits, [4, 4]), sample(logits, [r.params for r in reqs[1:]], [1, 2], [4, 4])
    )
