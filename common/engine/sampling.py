"""Sampling: SamplingParams and a batched sampler (greedy, temperature, top-k, top-p, min-p).

Randomness is counter-based: the uniform number that picks request r's token at output position
n is a hash of (seed_r, n). No generator state is carried, so a seeded request gives the same tokens
whatever batch it shares, on any device, and across the prefill -> decode handoff (prefill samples
position 0, decode the rest). A token is chosen by inverse CDF over the (filtered) distribution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_k: int = -1                   # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None           # None: a random seed is drawn once per request
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the bad field."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """top-k, top-p or min-p narrows the distribution (sampling must sort)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def resolved_seed(self) -> int:
        """The seed to use; call once per request and keep it (None draws a fresh one)."""
        return self.seed if self.seed is not None else random.getrandbits(63)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, output position)."""
    return (_splitmix64(_splitmix64(seed) ^ position) >> 11) * (1.0 / (1 << 53))


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> torch.Tensor:
    """logits [B, V] (float32) -> token ids [B] (int64, same device). positions = output index of each token.

    Greedy rows take the argmax. Rows with temperature only draw by inverse CDF over the vocabulary
    in id order (no sort: O(V)); rows with top-k / top-p / min-p sort once to apply the filters."""
    tokens = torch.argmax(logits, dim=-1)
    plain = [i for i, p in enumerate(params) if not p.greedy and not p.filtered]
    filtered = [i for i, p in enumerate(params) if not p.greedy and p.filtered]
    if plain:
        _draw(logits, tokens, plain, params, seeds, positions, filters=False)
    if filtered:
        _draw(logits, tokens, filtered, params, seeds, positions, filters=True)
    return tokens


def _draw(logits, tokens, rows, params, seeds, positions, filters: bool) -> None:
    device = logits.device
    idx = torch.tensor(rows, device=device)
    sub = logits[idx].float()
    temperature = torch.tensor([params[i].temperature for i in rows], device=device)[:, None]
    probs = torch.softmax(sub / temperature, dim=-1)
    u = torch.tensor([uniform(seeds[i], positions[i]) for i in rows], device=device, dtype=probs.dtype)
    if not filters:
        cdf = torch.cumsum(probs, dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=sub.shape[1] - 1)
        tokens[idx] = pick.squeeze(1)
        return
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(sub.shape[1], device=device)[None, :]
    top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else sub.shape[1] for i in rows], device=device)
    top_p = torch.tensor([params[i].top_p for i in rows], device=device)
    min_p = torch.tensor([params[i].min_p for i in rows], device=device)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs    # mass strictly ahead of each candidate
    keep = (rank < top_k[:, None]) & (before < top_p[:, None])
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True                                              # the most likely token always survives
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    cdf = torch.cumsum(kept, dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=sub.shape[1] - 1)
    pick = torch.minimum(pick, keep.sum(-1, keepdim=True) - 1)     # float edge: stay inside the kept set
    tokens[idx] = order.gather(1, pick).squeeze(1)
