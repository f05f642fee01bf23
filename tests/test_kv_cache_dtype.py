"""`--kv-cache-dtype bfloat16` (CPU float32 models, common/engine/kv_pool.py): K and V rounded to bf16 as they
are written, widened exactly as they are read. The served pair is token for token HF float32 generate
whose cache rounds every K and V it stores to bf16 (after the rotary, as ours does) and hands back the
rounded values, for the current token too; the pool holds twice the slots per byte."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from common.engine.draft_runner import SpecArgs
from common.engine.kv_pool import bytes_per_slot, resolve_kv_dtype
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.tools.eagle_checkpoint import build as build_head
from tests.decode_harness import Pair
from tests.oracle import hf_model
from tests.test_cpu_fused_layer import _count
from tests.test_low_precision import _hf_rounded, _untied

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(60, 80))]
NEW = 24


class Bf16Cache(DynamicCache):
    """HF's cache with every K and V it stores rounded to bf16 (and back to float32)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = (t.to(torch.bfloat16).float() for t in (key_states, value_states))
        return super().update(*rounded, layer_idx, *args, **kwargs)


def _served(pair: Pair) -> dict:
    """PROMPTS through the pair, greedy, NEW tokens each; closed after (its pools' integrity checked)."""
    try:
        return pair.run(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    finally:
        pair.close()


def _hf_tokens(model, prompt: list[int], cache: DynamicCache | None) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
            cache=cache,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name,fmt", [("llama", "none"), ("qwen2-tied", "none"), ("qwen3", "none"), ("llama", "w8a8")])
def test_served_tokens_equal_hf_fp32_with_its_kv_rounded_to_bf16(checkpoint, ops, name, fmt):
    """Both services' pools in bf16 (the handoff carries bf16 KV), decode steps of 1-4 rows in the
    whole-stack step (its attention reading bf16 rows), prefill's extends through the fused attention:
    every answer is HF's with the rounding cache (with w8a8: HF with w8a8's rounding too, a prompt whose
    oracle meets an input rounding tie left out, at most one). Not vacuous: the rounding moves HF's logits
    (and with float32 pools 3 of these 4 cases fail)."""
    path = checkpoint(name)
    pair = Pair(path, quantization=fmt, kv_cache_dtype="bfloat16")
    pools = [pair.link.worker.runner.kv_pool, pair.worker.runner.kv_pool]
    assert all(pool.k_all.dtype == pool.v_all.dtype == torch.bfloat16 for pool in pools)
    counting = _count(pair.worker.runner)
    out = _served(pair)
    assert counting.calls > 0
    hf = hf_model(path) if fmt == "none" else _hf_rounded(path, fmt)
    moved, decided = 0.0, 0
    for i, p in enumerate(PROMPTS):
        ours = out[str(i)]
        want = _untied(hf, lambda p=p: _hf_tokens(hf, p, Bf16Cache()))
        if want is None:  # w8a8's oracle met an input rounding tie
            continue
        decided += 1
        assert ours == want, (name, i)
        with torch.inference_mode():  # the same tokens read with and without the rounding
            ids = torch.tensor([p + ours])
            rounded = hf(ids, cache=Bf16Cache()).logits[0]
            moved = max(moved, float((rounded - hf(ids).logits[0]).abs().max()))
    assert moved > 1e-4, moved
    assert decided >= len(PROMPTS) - 1, "the oracle's input rounding met a tie in more than one prompt"


@pytest.mark.parametrize("topk,steps,nodes", [(1, 3, 4), (2, 3, 6)], ids=["chain", "tree"])
def test_eagle_over_a_bf16_pool_equals_hf_with_its_kv_rounded(checkpoint, tmp_path, topk, steps, nodes):
    """EAGLE (a random head: drafts mostly rejected, the verify's extends over the bf16 pool through the torch
    attention with its tree mask) commits HF's tokens with the rounding cache; its own head's pool stays the
    model's dtype."""
    path = checkpoint("llama")
    spec = SpecArgs("EAGLE", build_head(path, "EAGLE", str(tmp_path)), steps, topk, nodes)
    pair = Pair(path, spec=spec, kv_cache_dtype="bfloat16")
    runner = pair.worker.runner
    assert runner.kv_pool.dtype == torch.bfloat16 and runner.draft.kv_pool.dtype == torch.float32
    out = _served(pair)
    hf = hf_model(path)
    for i, p in enumerate(PROMPTS):
        assert out[str(i)] == _hf_tokens(hf, p, Bf16Cache()), i


def test_a_bf16_pool_holds_twice_the_slots_of_the_same_bytes(checkpoint):
    path = checkpoint("llama")
    budget = 4 << 20
    full, half = (
        ModelRunner(RunnerArgs(path, kv_budget_bytes=budget, max_running_requests=2, kv_cache_dtype=kv))
        for kv in ("auto", "bfloat16")
    )
    assert full.kv_pool.dtype == torch.float32 and half.kv_pool.dtype == torch.bfloat16
    assert half.kv_pool.nbytes <= budget and full.kv_pool.nbytes <= budget
    assert half.kv_allocator.size in (2 * full.kv_allocator.size, 2 * full.kv_allocator.size + 1)
    cfg = half.model.config
    assert bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16) * 2 == bytes_per_slot(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32
    )


def test_the_kv_cache_dtype_is_refused_where_it_does_not_apply():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, cpu, latent=False) == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, cpu, latent=False) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, cuda, latent=False) == torch.bfloat16  # already the model's
    with pytest.raises(ValueError, match="must be one of"):
        resolve_kv_dtype("fp8", torch.float32, cpu, latent=False)
    for dtype, device, latent in (
        (torch.float32, cuda, False),
        (torch.float16, cpu, False),
        (torch.float32, cpu, True),
    ):
        with pytest.raises(ValueError, match="float32 model on CPU with grouped-query attention"):
            resolve_kv_dtype("bfloat16", dtype, device, latent=latent)
        # auto with a low-precision format: bf16 only where bfloat16 applies, else the model's
        assert resolve_kv_dtype("auto", dtype, device, latent=latent, quantized=True) == dtype
    assert resolve_kv_dtype("auto", torch.float32, cpu, latent=False, quantized=True) == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.float32, cpu, latent=False, quantized=True) == torch.float32
    assert resolve_kv_dtype("float32", torch.float32, cuda, latent=True) == torch.float32
    with pytest.raises(ValueError, match="float32 is for a float32 model"):
        resolve_kv_dtype("float32", torch.bfloat16, cuda, latent=False)


def test_a_low_precision_format_keeps_its_kv_in_bf16_unless_told_float32(checkpoint):
    """--quantization w8a8 with --kv-cache-dtype auto: a bf16 pool (twice the slots of the same bytes), and
    float32 when asked; without a format auto stays the model's float32."""
    path = checkpoint("llama")

    def runner(fmt, kv):
        args = RunnerArgs(path, kv_budget_bytes=4 << 20, max_running_requests=2, quantization=fmt, kv_cache_dtype=kv)
        return ModelRunner(args)

    low, kept, plain = runner("w8a8", "auto"), runner("w8a8", "float32"), runner("none", "auto")
    assert low.kv_pool.dtype == torch.bfloat16
    assert kept.kv_pool.dtype == plain.kv_pool.dtype == torch.float32
    assert low.kv_allocator.size in (2 * kept.kv_allocator.size, 2 * kept.kv_allocator.size + 1)
