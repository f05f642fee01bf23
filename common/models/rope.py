"""Rotary position embedding: inverse frequencies from `rope_parameters`, applied per token.

Supports rope_type "default", "linear" and "llama3" (Llama 3.1 frequency smoothing). Cos/sin are
computed in float32 from integer positions, exactly as transformers does, then cast to the
activation dtype.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(rope: dict, head_dim: int) -> torch.Tensor:
    base = float(rope["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}")


class RotaryEmbedding:
    """Holds float32 inverse frequencies (never cast with the model's dtype), one copy per device."""

    def __init__(self, rope: dict, head_dim: int):
        self._inv_freq = {torch.device("cpu"): inv_frequencies(rope, head_dim)}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, signed sin [T, 1, head_dim] (broadcast over heads). The sin's first half
        is negated here, once per forward, so `apply_rotary` needs no negation per layer."""
        device = positions.device
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        freqs = positions[:, None].float() * self._inv_freq[device][None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : freqs.shape[1]].neg_()
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by the half-split convention: HF's x * cos + rotate_half(x) * sin
    with rotate_half(x) = [-x2, x1], here [x2, x1] * the signed sin from `cos_sin` (bit-identical:
    negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin  # roll by half: [x2, x1]
