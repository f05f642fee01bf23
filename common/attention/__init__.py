"""Attention backends behind one interface (`AttentionBackend`); `create_backend` picks one by name."""

from common.attention.base import AttentionBackend
from common.attention.batched import BatchedBackend
from common.attention.torch_ref import TorchReferenceBackend
from common.attention.triton_backend import TritonBackend

# "torch" is the per-request reference (the oracle for the others); "batched" is the default;
# "triton" the paged GPU kernels (on CPU only under Triton's interpreter, for tests).
BACKENDS = {"batched": BatchedBackend, "torch": TorchReferenceBackend, "triton": TritonBackend}


def create_backend(name: str, kv_pool, req_to_token_pool) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name](kv_pool, req_to_token_pool)


__all__ = ["AttentionBackend", "BatchedBackend", "TorchReferenceBackend", "TritonBackend", "create_backend", "BACKENDS"]
