"""Rotary position embedding: inverse frequencies from `rope_parameters`, applied per token.

Supports rope_type "default", "linear", "llama3" (Llama 3.1 frequency smoothing) and "yarn"
(DeepSeek-V3: interpolated frequencies and an attention factor that scales cos/sin). Cos/sin are
computed in float32 from integer positions, exactly as transformers does, then cast to the
activation dtype.
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(rope: dict, max_positions: int | None) -> float:
    factor = rope.get("factor")
    return float(factor) if factor is not None else max_positions / float(rope["original_max_position_embeddings"])


def attention_factor(rope: dict, max_positions: int | None = None) -> float:
    """What cos and sin are multiplied by (YaRN's mscale ratio; 1 for the other types)."""
    if rope.get("rope_type", "default") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, mscale, mscale_all = _yarn_factor(rope, max_positions), rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all))
    return yarn_mscale(factor)


def _yarn(rope: dict, head_dim: int, max_positions: int | None) -> torch.Tensor:
    """transformers' _compute_yarn_parameters: extrapolated and interpolated frequencies blended by a ramp."""
    base, factor = float(rope["rope_theta"]), _yarn_factor(rope, max_positions)
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    old_len = rope["original_max_position_embeddings"]

    def dim_of(rotations):
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)  # built under meta too
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def inv_frequencies(rope: dict, head_dim: int, max_positions: int | None = None) -> torch.Tensor:
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
    if kind == "yarn":
        return _yarn(rope, head_dim, max_positions)
    raise ValueError(f"unsupported rope_type {kind!r}")


class RotaryEmbedding:
    """Holds float32 inverse frequencies (never cast with the model's dtype), one copy per device. On CPU,
    cos and sin come from a table of every position up to the highest seen so far (per dtype; doubled
    when a position is beyond it): one index_select each per forward instead of ~8 ops (a batch-1 decode
    step spent ~90 us in them, each op's caches cold after the weights streamed past: 2-core AMD Zen 4)."""

    def __init__(self, rope: dict, head_dim: int, max_positions: int | None = None):
        self._inv_freq = {torch.device("cpu"): inv_frequencies(rope, head_dim, max_positions)}
        self.scale = attention_factor(rope, max_positions)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # CPU: cos, signed sin [N, d]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, signed sin [T, head_dim] in `dtype`."""
        device = positions.device
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        freqs = positions[:, None].float() * self._inv_freq[device][None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:  # YaRN's attention factor, as transformers applies it (before the cast)
            cos, sin = cos * self.scale, sin * self.scale
        sin[:, : freqs.shape[1]].neg_()
        return cos.to(dtype), sin.to(dtype)

    def table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """CPU: the cos and signed sin [N, head_dim] of every position below N made so far (`cos_sin` grows them),
        or None before the first."""
        return self._tables.get(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, signed sin [T, 1, head_dim] (broadcast over heads). The sin's first half
        is negated here, once per forward, so `apply_rotary` needs no negation per layer."""
        if positions.device.type != "cpu":
            cos, sin = self._compute(positions, dtype)
            return cos[:, None, :], sin[:, None, :]
        table = self._tables.get(dtype)
        try:
            if table is None:
                raise IndexError
            cos, sin = table[0].index_select(0, positions), table[1].index_select(0, positions)
        except (IndexError, RuntimeError):  # a position beyond the table (or none yet): grow it, then index
            if positions.numel() and int(positions.min()) < 0:
                raise ValueError("negative position") from None
            size = max(4096, 2 * (int(positions.max()) + 1) if positions.numel() else 0)
            self._tables[dtype] = table = self._compute(torch.arange(size), dtype)
            cos, sin = table[0].index_select(0, positions), table[1].index_select(0, positions)
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by the half-split convention: HF's x * cos + rotate_half(x) * sin
    with rotate_half(x) = [-x2, x1], here [x2, x1] * the signed sin from `cos_sin` (bit-identical:
    negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin  # roll by half: [x2, x1]
