"""oneDNN-packed linear layers for CPU inference.

On CPU, `F.linear` goes to MKL's sgemm, which is slow for the skinny shapes of decode (a few to a
few dozen rows against a wide weight). oneDNN can re-lay a weight out once in its blocked format
and then run those shapes up to ~2x faster (measured on this project's 2-core CPU machine: a
SmolLM2-135M decode step at batch 16 went from 160 to 93 ms; the tied 49k-row lm_head at 16 rows
from 36 to 13 ms). `pack_linears(model)` swaps every nn.Linear for a `PackedLinear` holding the
packed weight, and packs the lm_head weight for `compute_logits`. The model must be loaded first
(the checkpoint loader writes the plain parameters). Results equal F.linear within fp32 rounding.
Only for CPU: on CUDA, cuBLAS needs no such step and this module is never used.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; measured fine from 1 to 64


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias, "none", [], "")
    return out.view(*shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def pack_linears(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear under `module` (in place) by a PackedLinear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)
    return module
