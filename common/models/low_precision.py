"""Low-precision linears on CPU (`--quantization w8 | bf16 | bf16-matmul | w8a8`): fewer bytes for a decode
step to stream, and with bf16-matmul and w8a8 fewer instructions for a many-row GEMM.

A batch-1 decode step on CPU reads every weight once, so its floor is the weight bytes over the memory
bandwidth (bench/floor.py): fp32 streams 4 bytes per parameter. Here each linear's [out, in] weight is
stored in one of four formats; norms, attention, the residual stream and the KV cache stay float32:
- `w8`: int8 with a float32 scale per output row (its absmax / 127, rounded to nearest): 1 byte,
  weight-only (the linears' inputs float32);
- `bf16`: the weight rounded to bfloat16 (to nearest even): 2 bytes, weight-only. Widening bf16 to
  float is exact, so a bf16 linear computes exactly what float32 computes with the rounded weight: the
  model is the fp32 model with its linears' weights rounded, and nothing else changes;
- `bf16-matmul`: the bf16 weight, and each linear's input rounded to bf16 too: every product bf16 x bf16
  (exact in float32), summed in float32: the model is the fp32 model with its linears' weights and inputs
  rounded. What it buys is arithmetic: at the rows of a large decode batch or a prefill chunk a linear
  is bound by multiply-adds, not bytes, and AVX512-BF16's `vdpbf16ps` does two per lane per instruction
  (SmolLM2's linears at 64 rows on a 2-core AMD Zen 4: 36 ms, against 72-75 ms for the fp32 and bf16
  panels); at one row it streams the bf16 bytes (there ~10% slower than the bf16 gemv in a whole step);
- `w8a8`: int8 weights with a bf16 scale per row and block of W_BLOCK k (the block's absmax / 127 rounded
  up to a bf16; Q8_0 scales each block of 32 too), and each linear's input quantized to int8 as it
  arrives, per row and block of X_BLOCK k (scale absmax / 127; llama.cpp quantizes activations per 32):
  per input block the integer products summed exactly in int32 (AVX512-VNNI's `vpdpbusd`: four
  multiply-adds per lane per instruction), each block's sum scaled by the input's and the weights' scales
  and added in float32. The model is the fp32 model with its linears' weights and inputs quantized.
  SmolLM2, teacher-forced along our fp32 answers to bench/quality_bench.py's 50 questions (48 tokens; in
  process, 2-core AMD Zen 4), the share of positions whose greedy token is fp32's and the mean KL from
  fp32: a scale per row and inputs per 32 (this format before) 95.0% / 6.9e-3; per block of 32 and inputs
  per 32 (Q8_0's linears) 96.5% / 4.3e-3; per 32 and inputs per 16 (now) 97.2% / 3.1e-3. Per 16 costs
  its linears ~5% at one row and ~20% at 64 against per 32. SmolLM2's 120 layer linears, per row and
  inputs per 32: 29 ms at 64 rows, against 41 for the bf16 matmul and 93 for the w8 gemv; 4.2 at one row
  (the w8 gemv 3.9).
With the fused CPU ops w8 and bf16 have two layouts each: the gemv, named as the format (`w8`: `gemv_w8`,
`bf16`: `gemv` on the bf16 rows; the stored rows streamed and widened in registers once per 4 rows,
common/kernels/cpu_gemv.cpp), and `w8-panels` / `bf16-panels` (the panel GEMM on panels of the stored
weights, widening as it loads, w8's scale applied per output: common/kernels/cpu_gemm.cpp). `quantize`
times both over the model's linears per row bucket up to GEMV_ROWS on this host (best of ROUNDS
interleaved rounds, ~1.5 s for SmolLM2; on a 2-core AMD Zen 4 the gemv won at 1-2 rows by 1.6-2.1x, the
panels from 8 rows for bf16 and from 4 for w8 by 1.1-1.3x) and plans the faster; above GEMV_ROWS the
panels. bf16-matmul and w8a8 have one layout each, named as the format, at every row count: the bf16
matmul on pairs of k (common/kernels/cpu_bf16.cpp) and the int8 matmul on quads of k
(common/kernels/cpu_int8.cpp), whose sums do not depend on the batch's rows. Where the CPU lacks
AVX512-BF16 / VNNI they compute the same sums with wider instructions (the bf16 panels' speed for the first).
Without the fused ops a float32 copy made for the call feeds one GEMM (its cost shared by the rows).
`quantize(weights, fmt)` converts the runner's LinearWeights in place (the lm_head too: it is a fifth of
SmolLM2's bytes; a tied embedding stays fp32 for the lookup), after the fp32 arena is placed; the stored
weights get an arena of their own on 2 MiB pages, and their packed copies (quads, pairs, panels) a second
one (common/models/weight_arena.py). No fp32 layout
tuning: decode batches run the whole-stack fused step in the format's layouts, and the greedy head is
off (it would read an fp32 copy).
Accuracy: not token-exact with fp32 by design; tests/test_low_precision.py checks w8's logits against HF
fp32 and greedy agreement where HF's top-2 gap is wide, bf16, bf16-matmul and w8a8 token for token against
HF fp32 with the same rounding of weights (and of every linear's input for the last two), and the quality
benchmark compares answers with fp32's.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from common.models.packed_linear import LOW_PRECISION_LAYOUTS as LAYOUTS
from common.models.packed_linear import ROW_BUCKETS, LinearWeight
from common.models.weight_arena import gather, hugepage_empty

log = logging.getLogger(__name__)

# the gemv streams the stored rows once per 4 rows; SmolLM2's 120 layer linears in int8 at 8 / 16 / 32 / 64
# rows took 26 / 49 / 94 / 180 ms that way, 217 / 176 / 225 / 261 dequantized for an MKL GEMM, and 98 /
# 108 / 134 / 176 in fp32 MKL (2-core AMD EPYC, AVX2, 2026-11-27): the gemv serves every decode batch up to
# 64 rows
GEMV_ROWS = 64
FORMATS = ("w8", "bf16", "bf16-matmul", "w8a8")
ROUNDS = 3
BYTES = {"w8": 1, "bf16": 2, "bf16-matmul": 2, "w8a8": 1}
DTYPES = {"w8": torch.int8, "bf16": torch.bfloat16, "bf16-matmul": torch.bfloat16, "w8a8": torch.int8}
MATMULS = ("bf16-matmul", "w8a8")  # the formats (each its one layout) whose linears quantize their inputs too
X_BLOCK = 16  # w8a8: k per input scale
W_BLOCK = 32  # w8a8: k per weight scale (a multiple of X_BLOCK)
HOW = {  # what each format stores, for the start-up log
    "w8": "int8 with a scale per output row",
    "bf16": "bf16 (activations and KV float32)",
    "bf16-matmul": "bf16 with their inputs rounded to bf16 (sums, the rest and KV float32)",
    "w8a8": f"int8 with a bf16 scale per row and block of {W_BLOCK}, their inputs int8 per block of {X_BLOCK} "
    "(sums exact in int32)",
}


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 scale [out]): each row as round(w / s), s = absmax / 127 (0 rows: s = 1)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def quantize_blocks(weight: torch.Tensor, block: int = W_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], bf16 scale [out, in / block]): each row's blocks of `block` as round(w / s), s = the
    block's absmax / 127 rounded up to a bf16 (so that |w| / s <= 127: the bf16 scale adds no error of its
    own; 0 blocks: s = 1)."""
    w = weight.detach().float()
    blocks = w.reshape(w.shape[0], -1, block)
    want = blocks.abs().amax(dim=-1) / 127.0
    s = want.to(torch.bfloat16)
    s = torch.where(s.float() < want, (s.view(torch.int16) + 1).view(torch.bfloat16), s)  # positive: next bf16 up
    s = torch.where(want > 0, s, torch.ones_like(s))
    q = torch.round(blocks / s.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(w.shape), s.contiguous()


def quantized_input(x: torch.Tensor, block: int = X_BLOCK) -> torch.Tensor:
    """w8a8's input as its linears compute with it: each row's blocks of `block` k as round(x / s) * s,
    s = the block's absmax / 127 (1 for an all-zero block); what the int8 matmul does on the fly."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    s = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(blocks / s).clamp_(-127, 127) * s).reshape(x.shape)


def stored(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`weight` in `fmt`: (the stored [out, in] tensor, w8's scale per row [out], w8a8's per row and block
    [out, in / W_BLOCK], or None)."""
    if fmt == "w8a8":
        return quantize_blocks(weight)
    if DTYPES[fmt] == torch.int8:
        return quantize_rows(weight)
    return weight.detach().to(torch.bfloat16), None


def pack_matmul(ops, fmt: str, w: LinearWeight) -> None:
    """`w`'s stored weight packed for `fmt`'s matmul (w.low_panels; in w8a8 its scales too, w.low_panel_scales)
    and its call w.gemm(x, packed, n, bias, residual)."""
    if fmt == "w8a8":
        w.low_panels, w.low_panel_scales = ops.pack_int8_quads(w.low), ops.pack_int8_scales(w.low_scale)
        w.gemm = lambda x, quads, n, bias, residual: ops.gemm_int8(
            x, quads, w.low_panel_scales, n, X_BLOCK, bias, residual
        )
    else:
        w.low_panels, w.gemm = ops.pack_bf16_pairs(w.low), ops.gemm_bf16


def quantize(weights: list[LinearWeight], fmt: str, ops=None) -> int:
    """Convert `weights` to `fmt` in place (one arena for all) and plan their layouts (with the fused CPU
    ops `ops`: timed here, see the module's docstring); returns the stored weights' bytes, scales included."""
    if fmt not in FORMATS:
        raise ValueError(f"low-precision format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "bf16-matmul" and any(w.in_features % 2 for w in weights):
        raise ValueError(f"{fmt}: every linear's in-features must be even (its products go by pairs of k)")
    if fmt == "w8a8" and any(w.in_features % W_BLOCK for w in weights):
        raise ValueError(f"{fmt}: every linear's in-features must be a multiple of {W_BLOCK} (its weights' blocks)")
    parts = [stored(w.weight, fmt) for w in weights]
    total = sum(q.numel() for q, _ in parts)
    arena = hugepage_empty(-(-total * BYTES[fmt] // 4)).view(DTYPES[fmt])[:total]
    start = 0
    for w, (q, scale) in zip(weights, parts):
        w.low = arena[start : start + q.numel()].view(q.shape)
        w.low.copy_(q)
        w.low_scale, w.low_run = scale, run
        w.low_panels = w.low_panel_scales = None
        if ops is not None and fmt in MATMULS:
            pack_matmul(ops, fmt, w)
        elif ops is not None:
            w.low_panels, w.gemm = ops.pack_panels(w.low), ops.gemm_panels
        start += q.numel()
        w.packed = w.panels = None  # the oneDNN and panel copies' memory back
        w.plan = (fmt,) * len(ROW_BUCKETS)
    for attr in ("low_panels", "low_panel_scales"):  # the packed copies on 2 MiB pages too, as the stored weights
        gather(weights, attr)
    if ops is not None and fmt not in MATMULS:
        set_plan(weights, timed_plan(weights, fmt))
    return total * BYTES[fmt] + sum(s.numel() * s.element_size() for _, s in parts if s is not None)


def layouts(fmt: str) -> tuple[str, ...]:
    """`fmt`'s layouts: the weight-only formats' gemv and panels, the matmul formats' one."""
    return (fmt,) if fmt in MATMULS else (fmt, f"{fmt}-panels")


def set_plan(weights: list[LinearWeight], plan: tuple[str, ...]) -> None:
    """Every weight in `plan` (a layout of LAYOUTS per row bucket; tests pin one this way)."""
    if len(plan) != len(ROW_BUCKETS) or not set(plan) <= set(LAYOUTS):
        raise ValueError(f"a low-precision plan names one of {LAYOUTS} per row bucket {ROW_BUCKETS}, got {plan}")
    for w in weights:
        w.plan = tuple(plan)


def timed_plan(weights: list[LinearWeight], fmt: str) -> tuple[str, ...]:
    """Per row bucket up to GEMV_ROWS, the faster of `fmt`'s gemv and its panels through all `weights` in
    turn (each from memory, as in a forward; best of ROUNDS interleaved rounds); the panels above."""
    gemv, panels = layouts(fmt)
    plan, lines, begin = [], [], time.perf_counter()
    with torch.inference_mode():
        for rows in ROW_BUCKETS:
            if rows > GEMV_ROWS:
                plan.append(panels)
                continue
            xs = {k: torch.randn(rows, k) for k in {w.in_features for w in weights}}
            best = {}
            for r in range(ROUNDS):
                for layout in (gemv, panels)[:: 1 if r % 2 else -1]:
                    start = time.perf_counter()
                    for w in weights:
                        w.run(layout, xs[w.in_features])
                    best[layout] = min(best.get(layout, float("inf")), time.perf_counter() - start)
            plan.append(min(best, key=best.get))
            lines.append(f"{rows}: gemv {1e3 * best[gemv]:.1f} / panels {1e3 * best[panels]:.1f}")
    log.info("%s linears, ms per pass of all at each row bucket (%.1f s): %s; plan %s", fmt,
             time.perf_counter() - begin, ", ".join(lines), ", ".join(plan))  # fmt: skip
    return tuple(plan)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 weight of `stored` (bf16, or int8 with its scale per row [out] or per row and block
    [out, blocks])."""
    if scale is None:
        return stored.float()
    if scale.dim() == 2:
        return stored.float() * scale.float().repeat_interleave(stored.shape[1] // scale.shape[1], dim=1)
    return stored.float() * scale[:, None]


def dequantized(w: LinearWeight) -> torch.Tensor:
    """The float32 weight a converted linear computes with."""
    return dequantize(w.low, w.low_scale)


def run(w: LinearWeight, x2: torch.Tensor, residual: torch.Tensor | None, layout: str | None = None) -> torch.Tensor:
    """[rows, out] = residual + x2 @ dequantized(w).T + bias, in `layout` (LAYOUTS; default: the format's gemv);
    in bf16-matmul x2 rounded to bf16 first, in w8a8 quantized (quantized_input)."""
    rows = x2.shape[0]
    if layout in MATMULS and w.low_panels is not None and w.gemm is not None:
        return w.gemm(x2.contiguous(), w.low_panels, w.out_features, w.bias, residual)
    if layout == "bf16-matmul":  # no fused ops: the rounded input through one GEMM
        x2 = x2.to(torch.bfloat16).float()
    elif layout == "w8a8":
        x2 = quantized_input(x2)
    elif layout is not None and layout.endswith("-panels") and w.low_panels is not None and w.gemm is not None:
        return w.gemm(x2.contiguous(), w.low_panels, w.out_features, w.bias, residual, w.low_scale)
    elif rows <= GEMV_ROWS:
        if w.low_scale is not None and w.gemv_w8 is not None:
            return w.gemv_w8(x2.contiguous(), w.low, w.low_scale, w.bias, residual)
        if w.low_scale is None and w.gemv is not None:
            return w.gemv(x2.contiguous(), w.low, w.bias, residual)
    out = F.linear(x2, dequantized(w), w.bias)
    return out if residual is None else residual + out
