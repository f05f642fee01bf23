"""A decode step's linears on CUDA at a few rows: a Triton GEMV, or cuBLAS, whichever timed faster
for that weight's shape at that row count when the runner warmed up.

At batch 1 a decode step reads every weight once; cuBLAS's kernels read most of Llama-3.1-8B's
matrices at ~2.9-3.0 TB/s on an H100 but its 4096 x 4096 o_proj at ~1.6 TB/s (BENCHMARKS.md). The
GEMV here gives each program BLOCK_N weight rows, walks K in BLOCK_K steps (the loads pipelined over
`num_stages`), and multiplies the x rows (padded to 16, masked) by them with `tl.dot` accumulating in
fp32 (exact fp32 products for fp32 weights); bias added before the one rounding, as cuBLAS's
epilogue does.

`wrap(model)` swaps each nn.Linear of the decoder's layers for a GemvLinear sharing its parameters;
`tune(model)` times, per (out, in, dtype, bias) shape and row bucket (1, 2, 4, 8, 16 rows), cuBLAS
against each CONFIGS entry on random inputs and keeps the fastest (one log line per shape); an
untuned GemvLinear, or one over 16 rows, runs F.linear. Choices are host-side: the forward has no
sync and a captured graph keeps the kernel it was captured with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing
from torch import nn
from torch.nn import functional as F

from common.models.direct_call import DirectCall

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16)  # row counts a plan covers (a batch of m rows uses the first bucket >= m)
MIN_DOT = 16  # tl.dot's smallest side: the x rows are padded to it
# name -> (BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = {"gemv16": (16, 512, 4, 3), "gemv32": (32, 256, 4, 4), "gemv64": (64, 128, 4, 4)}


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[:M, n-block] = x[:M] @ w[n-block].T (+ bias): one program per BLOCK_N weight rows."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok, m_ok = offs_n < N, offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: str) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= 16, K] through the GEMV with CONFIGS[config]."""
    block_n, block_k, warps, stages = CONFIGS[config]
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(m, n)
    if m:
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=max(MIN_DOT, triton.next_power_of_2(m)),
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


class GemvLinear(DirectCall):
    """An nn.Linear's parameters with a per-row-bucket choice of kernel (`plan`: bucket -> a CONFIGS
    name, or None for cuBLAS), shared by every linear of the same shape."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.plan: dict[int, str | None] = {}

    def shape(self) -> tuple:
        return self.out_features, self.in_features, self.weight.dtype, self.bias is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else BUCKETS[-1] + 1
        bucket = next((b for b in BUCKETS if b >= rows), None)
        config = self.plan.get(bucket) if bucket is not None else None
        if config is None:
            return F.linear(x, self.weight, self.bias)
        return gemv(x, self.weight, self.bias, config)


def wrap(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` (in place) by a GemvLinear; returns how many."""
    n = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, GemvLinear(child))
            n += 1
        else:
            n += wrap(child)
    return n


def cuda_timer(fn: Callable[[], object], choice: str | None, rows: int) -> float:
    """Median microseconds of `fn` on the GPU, L2 flushed before each call (a real step finds the
    weights in memory, not in cache) and each launch queued behind the flush (a graph replays with
    no launch gaps): triton.testing.do_bench."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3


def tune(*modules: nn.Module, timer: Callable[[Callable[[], object], str | None, int], float] = cuda_timer) -> dict:
    """Time cuBLAS and each GEMV config per GemvLinear shape and row bucket and give every linear of
    that shape the plan; returns {shape: {bucket: (choice, us, cuBLAS us)}}. `timer(fn, choice, rows)`
    (tests pass their own) returns the time of `fn`, choice `choice` (None: cuBLAS) at `rows` rows."""
    groups: dict[tuple, list[GemvLinear]] = {}
    linears = {id(m): m for root in modules for m in root.modules() if isinstance(m, GemvLinear)}  # each once
    for m in linears.values():
        groups.setdefault(m.shape(), []).append(m)
    found = {}
    for shape, members in groups.items():
        w, b = members[0].weight, members[0].bias
        plan, found[shape] = {}, {}
        for bucket in BUCKETS:
            x = torch.randn(bucket, w.shape[1], device=w.device).to(w.dtype)
            times = {None: timer(lambda x=x, w=w, b=b: F.linear(x, w, b), None, bucket)}
            for name in CONFIGS:
                times[name] = timer(lambda x=x, w=w, b=b, name=name: gemv(x, w, b, name), name, bucket)
            best = min(times, key=times.get)
            plan[bucket] = best
            found[shape][bucket] = (best or "cublas", times[best], times[None])
        for m in members:
            m.plan = plan
        rows = ", ".join(f"{r}: {c} {us:.1f} us (cuBLAS {ref:.1f})" for r, (c, us, ref) in found[shape].items())
        log.info("CUDA GEMV %dx%d %s x%d: %s", shape[0], shape[1], str(shape[2])[6:], len(members), rows)
    return found
