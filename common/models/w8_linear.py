"""Weight-only int8 linears on CPU (`--quantization w8`): a quarter of the bytes a decode step streams.

A batch-1 decode step on CPU reads every weight once, so its floor is the weight bytes over the memory
bandwidth (bench/floor.py): fp32 streams 4 bytes per parameter, int8 one. Here each linear's [out, in]
weight becomes int8 with a float32 scale per output row (its absmax / 127, rounded to nearest), and
activations stay float32:
- up to W8_GEMV_ROWS rows (decode steps), the fused CPU ops' `gemv_w8` streams the int8 rows and
  widens them to float in registers (common/kernels/cpu_gemv.cpp), once per 4 rows;
- more rows (a prefill chunk), or without the fused ops, a float32 copy dequantized for the call
  feeds one GEMM (its cost shared by the rows).
`quantize(weights)` converts the runner's LinearWeights in place (the lm_head too: it is a tenth of
SmolLM2's bytes), after the fp32 arena is placed; the int8 weights get an arena of their own on 2 MiB
pages (common/models/weight_arena.py). Plans become "w8" for every row count: no layout tuning, the
whole-stack fused step with the int8 gemv, the greedy head off (it would read an fp32 copy).
Accuracy: not token-exact with fp32 by design; tests/test_w8_linear.py checks logits against HF fp32
and greedy agreement where HF's top-2 gap is wide, and the quality benchmark compares answers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.models.packed_linear import ROW_BUCKETS, LinearWeight
from common.models.weight_arena import hugepage_empty

# gemv_w8 streams the int8 rows once per 4 rows; SmolLM2's 120 layer linears at 8 / 16 / 32 / 64 rows took
# 26 / 49 / 94 / 180 ms that way, 217 / 176 / 225 / 261 dequantized for an MKL GEMM, and 98 / 108 / 134 /
# 176 in fp32 MKL (2-core AMD EPYC, AVX2, 2026-11-27): the gemv serves every decode batch up to 64 rows
W8_GEMV_ROWS = 64
LAYOUT = "w8"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 scale [out]): each row as round(w / s), s = absmax / 127 (0 rows: s = 1)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def quantize(weights: list[LinearWeight]) -> int:
    """Convert `weights` to w8 in place (one int8 arena for all); returns the int8 bytes."""
    parts = [quantize_rows(w.weight) for w in weights]
    total = sum(q.numel() for q, _ in parts)
    arena = hugepage_empty(-(-total // 4)).view(torch.int8)[:total]
    start = 0
    for w, (q, scale) in zip(weights, parts):
        w.w8 = arena[start : start + q.numel()].view(q.shape)
        w.w8.copy_(q)
        w.w8_scale, w.w8_run = scale, run
        start += q.numel()
        w.packed = w.panels = None  # the oneDNN and panel copies' memory back
        w.plan = (LAYOUT,) * len(ROW_BUCKETS)
    return total


def run(w: LinearWeight, x2: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """[rows, out] = residual + x2 @ (w8 * scale).T + bias."""
    if w.gemv_w8 is not None and x2.shape[0] <= W8_GEMV_ROWS:
        return w.gemv_w8(x2.contiguous(), w.w8, w.w8_scale, w.bias, residual)
    out = F.linear(x2, w.w8.float() * w.w8_scale[:, None], w.bias)
    return out if residual is None else residual + out
