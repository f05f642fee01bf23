"""Block-quantized fp8 checkpoints (DeepSeek-V3's published layout), dequantized at load.

config.json says `quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [bn, bk]}`. Each quantized linear weight `W` (float8_e4m3fn, [out, in])
comes with `W_scale_inv` (`<prefix>.weight_scale_inv`, float32, [ceil(out / bn), ceil(in / bk)]): the
real weight is `W[i, j] * scale_inv[i // bn, j // bk]`, the last row and column blocks cut short where
the shape is not a multiple of the block. Embeddings, norms, the router and the lm_head are stored
unquantized. There is no fp8 kernel here: the loader (common/models/loader.py) turns each such weight
into the model's dtype as it reads it, a few rows of blocks at a time, before any TP slicing.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from common.models.config import CheckpointError

log = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"  # `<prefix>.weight` -> `<prefix>.weight_scale_inv`
QUANT_METHODS = ("fp8",)
ACTIVATION_SCHEMES = ("dynamic",)  # "static" would add per-tensor input scales: not read here
FORMATS = {"e4m3": torch.float8_e4m3fn}
SCALE_FORMATS = ("float", "ue8m0")  # ue8m0 (V3.1): powers of two, still a float per block
CHUNK_ELEMENTS = 1 << 24  # about this many weight elements dequantized at once (64 MiB in float32)


@dataclass(frozen=True)
class Fp8Spec:
    block: tuple[int, int]  # weight_block_size: rows, columns
    dtype: torch.dtype  # the stored weights' dtype


def fp8_spec(quant: dict | None) -> Fp8Spec | None:
    """The checked quantization_config of a config.json (None: an unquantized checkpoint)."""
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = quant.get("quant_method")
    if method not in QUANT_METHODS:
        raise CheckpointError(
            f"config.json: quantization_config.quant_method={method!r} is not supported; "
            f"supported: {list(QUANT_METHODS)} (block-quantized, dequantized at load)"
        )
    scheme = str(quant.get("activation_scheme", "dynamic")).lower()
    if scheme not in ACTIVATION_SCHEMES:
        raise CheckpointError(
            f"config.json: quantization_config.activation_scheme={scheme!r} is not supported; "
            f"supported: {list(ACTIVATION_SCHEMES)}"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt not in FORMATS:
        raise CheckpointError(f"config.json: quantization_config.fmt={fmt!r}; supported: {list(FORMATS)}")
    scale_fmt = quant.get("scale_fmt") or "float"
    if scale_fmt not in SCALE_FORMATS:
        raise CheckpointError(
            f"config.json: quantization_config.scale_fmt={scale_fmt!r}; supported: {list(SCALE_FORMATS)}"
        )
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"config.json: quantization_config.weight_block_size={block!r}; expected two positive integers "
            "(per-tensor fp8 is not supported)"
        )
    return Fp8Spec(block=(block[0], block[1]), dtype=FORMATS[fmt])


def checkpoint_spec(path: str) -> Fp8Spec | None:
    """fp8_spec of the folder's config.json (None where it has none, or no quantization_config)."""
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        return None
    with open(config) as f:
        return fp8_spec(json.load(f).get("quantization_config"))


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale_inv shape of a weight of `shape`: one per block, the edge blocks included."""
    rows, cols = shape[-2:]
    return (*shape[:-2], -(-rows // block[0]), -(-cols // block[1]))


def dequantize_into(
    weight: torch.Tensor, scale_inv: torch.Tensor, spec: Fp8Spec, out: torch.Tensor, what: str = "weight"
) -> None:
    """out <- weight * scale_inv (one scale per block), in out's dtype and on its device, a band of
    block rows at a time so no float32 copy of the whole tensor is made. `what` names the tensor in
    errors (a wrong dtype, shape or scale grid)."""
    if weight.dtype != spec.dtype:
        raise CheckpointError(f"{what} is {weight.dtype}; an fp8 weight with a scale_inv must be {spec.dtype}")
    if weight.dim() < 2 or tuple(weight.shape) != tuple(out.shape):
        raise CheckpointError(f"{what} has shape {tuple(weight.shape)}, expected {tuple(out.shape)}")
    grid = scale_grid(tuple(weight.shape), spec.block)
    if tuple(scale_inv.shape) != grid:
        raise CheckpointError(
            f"{what}: its weight{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, expected {grid} "
            f"(weight {tuple(weight.shape)} in blocks of {list(spec.block)})"
        )
    bn, bk = spec.block
    rows, cols = weight.shape[-2:]
    lead = weight[..., :1, :1].numel()  # experts stacked in front, if any
    band = max(1, CHUNK_ELEMENTS // max(1, lead * bn * cols)) * bn  # rows per step, whole blocks
    scale_inv = scale_inv.to(out.device, torch.float32)
    with torch.no_grad():
        for r0 in range(0, rows, band):
            r1 = min(rows, r0 + band)
            w = weight[..., r0:r1, :].to(out.device).float()
            s = scale_inv[..., r0 // bn : -(-r1 // bn), :]
            s = s.repeat_interleave(bn, dim=-2)[..., : r1 - r0, :].repeat_interleave(bk, dim=-1)[..., :cols]
            out[..., r0:r1, :].copy_(w.mul_(s))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, spec: Fp8Spec, dtype: torch.dtype) -> torch.Tensor:
    """A new `dtype` tensor: the dequantized `weight`."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    dequantize_into(weight, scale_inv, spec, out)
    return out


def log_dequantized(path: str, count: int, spec: Fp8Spec, dtype: torch.dtype) -> None:
    log.info(
        "%s: %d fp8 weights (blocks of %s) dequantized to %s at load; no fp8 kernel is used",
        path,
        count,
        list(spec.block),
        str(dtype).removeprefix("torch."),
    )
