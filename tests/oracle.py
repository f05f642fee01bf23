"""The correctness oracle: HF transformers, float32, CPU, one prompt at a time, no padding (mixtures
of experts through HF's eager per-expert loop, its plain reference)."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False, eos_token_id=None): exactly max_new_tokens new ids."""
    out = hf_model(path).generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    new = out[0, len(prompt) :].tolist()
    assert len(new) == max_new_tokens, "oracle did not produce a fixed-length reference"
    return new


@torch.inference_mode()
def hf_logits(path: str, prompt: list[int]) -> torch.Tensor:
    """Logits [len(prompt), V] of one unpadded prompt."""
    return hf_model(path)(torch.tensor([prompt])).logits[0].float()


@torch.inference_mode()
def hf_sampled(path: str, prompt: list[int], max_new_tokens: int, seed: int, temperature: float, processors=()):
    """What a temperature-only request with `seed` must draw, from HF's distribution: each step HF's
    logits of the sequence so far, HF-style `processors` (called as (input_ids, scores)), / temperature,
    softmax; the token by inverse CDF in id order at the request's own uniform for that output index
    (common/engine/sampling.py's counter-based draw, the one piece of ours used here)."""
    from common.engine.sampling import uniform

    ids = list(prompt)
    for index in range(max_new_tokens):
        scores = hf_model(path)(torch.tensor([ids])).logits[:, -1].float()
        for proc in processors:
            scores = proc(torch.tensor([ids]), scores)
        cdf = torch.cumsum(torch.softmax(scores[0] / temperature, dim=-1), dim=-1)
        u = torch.tensor([uniform(seed, index) * cdf[-1].item()], dtype=cdf.dtype)
        ids.append(min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1))
    return ids[len(prompt) :]
