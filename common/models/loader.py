"""Load a Hugging Face checkpoint folder into our DecoderLM.

Handles a single `model.safetensors` and sharded checkpoints (`model.safetensors.index.json`).
Fails with a message naming the problem: unknown architecture (from ModelConfig), a missing,
unexpected or mis-shaped tensor, or a shard file the index names but the folder lacks. DeepSeek's
block-quantized fp8 checkpoints are dequantized at load (common/models/fp8.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import ExitStack

import torch
from safetensors import safe_open

from common.models import fp8
from common.models.config import CheckpointError, ModelConfig, load_model_config
from common.models.decoder import DecoderLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors some checkpoints carry that we derive ourselves.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(path: str) -> dict[str, list[str]]:
    """Map each safetensors file in the folder to the tensor names it should hold (None = all)."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{INDEX_FILE}: missing or empty 'weight_map'")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        for file in files:
            if not os.path.exists(os.path.join(path, file)):
                raise CheckpointError(f"{INDEX_FILE} names shard '{file}', which is not in {path}")
        return files
    if os.path.exists(os.path.join(path, SINGLE_FILE)):
        return {SINGLE_FILE: None}
    raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")


def copy_checked(tensor: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into its parameter (or view), or say which one has the wrong shape."""
    if tuple(tensor.shape) != tuple(dst.shape):
        raise CheckpointError(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(tensor.to(dst.dtype))


def load_tensors(
    path: str,
    params: dict[str, torch.Tensor],
    owner: str,
    label: str = "",
    rename: Callable[[str], str] = lambda name: name,
    skip: Callable[[str], bool] = lambda key: False,
) -> None:
    """Copy every tensor of the checkpoint folder `path` into `params` (name -> destination, checked
    shape), after `rename`; tensors whose name `skip`s are not read. A tensor missing from its shard,
    one `params` does not expect (named for `owner`), or one of `params` left unfilled is a
    CheckpointError (messages start with `label`). A block-quantized fp8 checkpoint's weights (those
    with a `*_scale_inv` sibling, common/models/fp8.py) are dequantized into their parameters."""
    spec = fp8.checkpoint_spec(path)
    loaded: set[str] = set()
    dequantized = 0
    with ExitStack() as stack:
        where: dict[str, tuple[str, object]] = {}  # tensor name -> (its file, the open file)
        for file, names in checkpoint_files(path).items():
            f = stack.enter_context(safe_open(os.path.join(path, file), framework="pt"))
            present = set(f.keys())
            for name in names if names is not None else sorted(present):
                if name not in present:
                    raise CheckpointError(f"{label}{file}: tensor '{name}' listed in {INDEX_FILE} is missing")
                where[name] = (file, f)
        for name, (file, f) in where.items():
            if name.endswith(fp8.SCALE_SUFFIX) and name.removesuffix(fp8.SCALE_SUFFIX) in where:
                continue  # read with its weight
            key = rename(name)
            if key.endswith(_IGNORED_SUFFIXES) or skip(key):
                continue
            if key not in params:
                raise CheckpointError(f"{label}{file}: unexpected tensor '{name}' for {owner}")
            what, scale = f"{label}{file}: tensor '{name}'", name + fp8.SCALE_SUFFIX
            tensor = f.get_tensor(name)
            if scale in where:
                if spec is None:
                    raise CheckpointError(f"{what} has a '{scale}' but config.json has no fp8 quantization_config")
                fp8.dequantize_into(tensor, where[scale][1].get_tensor(scale), spec, params[key], what)
                dequantized += 1
            elif tensor.element_size() == 1 and tensor.is_floating_point():
                raise CheckpointError(f"{what} is {tensor.dtype} without a '{scale}' to dequantize it by")
            else:
                copy_checked(tensor, params[key], what)
            loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{label}{path}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if dequantized:
        fp8.log_dequantized(f"{label}{path}", dequantized, spec, next(iter(params.values())).dtype)


def load_weights(model: DecoderLM, path: str) -> None:
    cfg = model.config
    tied = cfg.tie_word_embeddings  # tied: the embedding serves as lm_head
    # DeepSeek-V3's MTP (NextN) layer sits after the last layer; HF ignores it, and so do we for now
    mtp = f"model.layers.{cfg.num_layers}." if cfg.architecture == "DeepseekV3ForCausalLM" else None
    load_tensors(
        path,
        model.checkpoint_tensors(),
        cfg.architecture,  # HF names, fused projections as views
        skip=lambda name: (tied and name == "lm_head.weight") or (mtp is not None and name.startswith(mtp)),
    )


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """'auto' is float32 on CPU and bfloat16 on CUDA; otherwise a torch dtype name."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return value


def load_model(
    path: str, device: torch.device | str = "cpu", dtype: str | torch.dtype = "auto", config: ModelConfig | None = None
) -> DecoderLM:
    """Build the model on the meta device, allocate it on `device` in `dtype`, then load weights."""
    cfg = config or load_model_config(path)
    dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    load_weights(model, path)
    return model.eval().requires_grad_(False)
