"""Attention backends behind one interface (`AttentionBackend`); `create_backend` picks one by name,
`resolve_backend` turns `auto` into the one for the device."""

import importlib.util

import torch

from common.attention.base import AttentionBackend
from common.attention.batched import BatchedBackend
from common.attention.torch_ref import TorchReferenceBackend
from common.attention.triton_backend import TritonBackend

# "torch" is the per-request reference (the oracle for the others); "batched" is the default;
# "triton" the paged GPU kernels (on CPU only under Triton's interpreter, for tests).
BACKENDS = {"batched": BatchedBackend, "torch": TorchReferenceBackend, "triton": TritonBackend}


CHOICES = ["auto", *sorted(BACKENDS)]


def resolve_backend(name: str, device: torch.device | str) -> str:
    """`auto`: triton on CUDA when the package is there (paged kernels, and the only backend whose
    forwards CUDA graphs capture: 2.1 vs 50 ms per decode step of a 1B Llama at batch 1 on an H100,
    BENCHMARKS.md), batched elsewhere. Any other name is kept as given."""
    if name != "auto":
        return name
    if torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "batched"


def create_backend(name: str, kv_pool, req_to_token_pool) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name](kv_pool, req_to_token_pool)


__all__ = [
    "AttentionBackend",
    "BatchedBackend",
    "TorchReferenceBackend",
    "TritonBackend",
    "create_backend",
    "resolve_backend",
    "BACKENDS",
    "CHOICES",
]
