"""CPU fp32 linear layers: each weight in two layouts, one for GEMMs and one for GEMVs.

On CPU, `F.linear` goes to MKL's sgemm, which is slow for the skinny shapes of decode. Two layouts
beat it, each on its own range of rows (all figures measured on this project's 2-core CPU machine):
- oneDNN-packed (its blocked format, re-laid once): a few to a few dozen rows against a wide weight
  run up to ~2x faster (a SmolLM2-135M decode step at batch 16 went from 160 to 93 ms; the tied
  49k-row lm_head at 16 rows from 36 to 13 ms).
- Row blocks (`weight.view(parts, rows / parts, in)` and one `torch.bmm`): a single row is a GEMV,
  bound by memory bandwidth, and sgemm and oneDNN stream the weight at ~10 GB/s where the machine
  reads ~20; bmm runs the blocks on all threads at ~17-18 GB/s (the 30 layers of SmolLM2-135M at one
  row: 25 ms against 35 packed and 39 with F.linear). From 2 rows on the packed GEMM is used: on
  2026-11-25's machine it matched or beat bmm at 2-4 rows (10.7-11.7 ms against 11.6-13.1 for the
  30 layers), and bmm's [blocks, out, rows] result needs a transposing copy there (~1 ms a verify).
`pack_linears(model)` swaps every nn.Linear for a `PackedLinear`; `LinearWeight` (used for lm_heads)
holds both layouts of one weight. The row blocks are views of the plain weight, which stays alive:
the price is a second copy of every packed weight in memory. The model must be loaded first (the
checkpoint loader writes the plain parameters). Results equal F.linear within fp32 rounding (a
different summation order). Only for CPU: on CUDA, cuBLAS needs no such step and this module is
never used.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; measured fine from 1 to 64
GEMV_MAX_ROWS = 1  # the row blocks (bmm) for a single row only; see above


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class LinearWeight:
    """One [out, in] weight as oneDNN-packed (GEMM) and as row blocks (GEMV); call it like F.linear,
    with an optional residual added to the result (`residual + x @ W.T + bias`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach().contiguous()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        parts = next(p for p in (8, 4, 2, 1) if self.out_features % p == 0)
        self.blocks = weight.view(parts, self.out_features // parts, self.in_features)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        rows, shape = x2.shape[0], x.shape[:-1] + (self.out_features,)
        if rows > GEMV_MAX_ROWS:
            if residual is None:
                out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
            else:  # the add fused into the GEMM's epilogue (oneDNN binary post-op): bit-identical, one op fewer
                out = torch.ops.mkldnn._linear_pointwise.binary(
                    x2, residual.reshape(rows, -1).contiguous(), self.packed, self.bias, "add"
                )
            return out.view(shape)
        out = torch.bmm(
            self.blocks, x2.t().unsqueeze(0).expand(self.blocks.shape[0], -1, -1)
        )  # [parts, out/parts, rows]
        out = out.view(1, -1) if rows == 1 else out.view(-1, rows).t().contiguous()
        if self.bias is not None:
            out = out + self.bias
        if residual is not None:
            out = residual.reshape(rows, -1) + out
        return out.reshape(shape)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = LinearWeight(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight(x)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x) (see `common.models.decoder.linear_add`)."""
        return self.weight(x, residual)


def pack_linears(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear under `module` (in place) by a PackedLinear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)
    return module
