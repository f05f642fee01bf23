"""Our model over paged KV matches HF transformers: extend logits and greedy tokens, per architecture."""

from __future__ import annotations

import pytest
import torch

from common.engine.colocated import ColocatedLoop
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from tests.oracle import hf_greedy, hf_logits

VARIANTS = ["llama", "qwen2", "qwen3", "qwen2-tied", "qwen3-sharded"]
CHUNK = 16
NEW_TOKENS = 32


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [1, 5, 13, 3 * CHUNK + 5]  # one of length 1, one prefilled in several chunks
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _runner(path: str) -> ModelRunner:
    return ModelRunner(RunnerArgs(path, max_total_tokens=2048, max_running_requests=8))


def _reserve(runner: ModelRunner, n: int) -> int:
    row = runner.req_to_token_pool.alloc()
    runner.req_to_token_pool.write(row, 0, runner.kv_allocator.alloc(n))
    return row


@pytest.mark.parametrize("variant", VARIANTS)
def test_extend_logits_match_hf(checkpoint, variant):
    path = checkpoint(variant)
    runner = _runner(path)
    prompts = _prompts(runner.config.vocab_size)
    rows = [_reserve(runner, len(p)) for p in prompts]
    batch = ForwardBatch.extend(
        runner.req_to_token_pool.req_to_token, rows, [0] * len(prompts), prompts, all_logits=True
    )
    logits, _ = runner.forward(batch)
    ref = torch.cat([hf_logits(path, p) for p in prompts])
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_chunked_extend_continues_from_pool(checkpoint, variant):
    """Extending a prompt in pieces over KV already in the pool gives the one-shot logits."""
    path = checkpoint(variant)
    runner = _runner(path)
    [prompt] = _prompts(runner.config.vocab_size)[-1:]
    row = _reserve(runner, len(prompt))
    table = runner.req_to_token_pool.req_to_token
    pieces, start = [], 0
    for end in (7, 8, 30, len(prompt)):
        batch = ForwardBatch.extend(table, [row], [start], [prompt[start:end]], all_logits=True)
        pieces.append(runner.forward(batch)[0])
        start = end
    torch.testing.assert_close(torch.cat(pieces), hf_logits(path, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_match_hf_generate(checkpoint, variant):
    path = checkpoint(variant)
    runner = _runner(path)
    prompts = _prompts(runner.config.vocab_size)
    loop = ColocatedLoop(runner, chunk_size=CHUNK)
    reqs = loop.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, req in zip(prompts, reqs):
        assert req.output == hf_greedy(path, prompt, NEW_TOKENS), f"prompt of length {len(prompt)}"
        assert req.finish_reason == "length"
    assert len({t for r in reqs for t in r.output}) > 4, "degenerate outputs make a weak oracle check"
    runner.kv_allocator.check_integrity(holders=[])
    runner.req_to_token_pool.allocator.check_integrity(holders=[])


@pytest.mark.parametrize("variant", ["qwen2", "qwen2-tied"])
def test_every_cpu_linear_layout_gives_the_plain_logits(checkpoint, variant):
    """Each CPU fp32 layout, forced or chosen by timing (`auto`), gives F.linear's logits (`mkl`)."""
    from common.models.packed_linear import LAYOUTS, PackedLinear

    path = checkpoint(variant)
    runs = {}
    for layout in ("mkl", "onednn", "rowblock", "panels", "auto"):
        runner = ModelRunner(RunnerArgs(path, max_total_tokens=512, max_running_requests=4, linear_layout=layout))
        packed = [m.weight for m in runner.model.modules() if isinstance(m, PackedLinear)]
        assert packed and runner.model._lm_head_cpu is not None
        for w in packed + [runner.model._lm_head_cpu]:
            assert set(w.plan) <= set(LAYOUTS) and (layout == "auto" or set(w.plan) == {layout})
            assert (w.packed is not None) == ("onednn" in w.plan)  # an unused oneDNN copy is dropped
            assert (w.panels is not None) == ("panels" in w.plan)  # and an unused panel copy
        prompts = _prompts(runner.config.vocab_size)
        rows = [_reserve(runner, len(p)) for p in prompts]
        runs[layout] = runner.forward(
            ForwardBatch.extend(runner.req_to_token_pool.req_to_token, rows, [0] * len(rows), prompts, all_logits=True)
        )[0]
    for layout, logits in runs.items():
        assert torch.allclose(logits, runs["mkl"], atol=1e-4, rtol=1e-4), (layout, (logits - runs["mkl"]).abs().max())
