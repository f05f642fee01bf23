"""The attention backend interface the model calls once per layer.

A backend owns how K/V are stored and read: `forward` writes this forward's k, v into the KV pool
at `forward_batch.out_cache_loc`, then attends each request's queries over its whole KV (prefix +
new tokens, causal) found through its ReqToTokenPool row. `init_forward_metadata` runs once per
forward before the layers (index tensors, kernel plans).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from common.forward.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    def __init__(self, kv_pool, req_to_token_pool):
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:  # noqa: B027 (an optional hook)
        """Per-forward preparation shared by all layers (default: nothing)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, forward_batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> attention output [T, heads, d]."""
