"""The messages rank 0's decode worker scatters to its TP followers (tp_worker.py), one per piece of
stream work, in the order rank 0's stream runs them. Plain frozen dataclasses made of fields only:
the TP codec (common/parallel/tp_codec.py, MESSAGE_TYPES) carries them, and every rank dispatches
by type (`tp_worker.apply`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.handoff import Handoff
from decode_service.handoff_writes import ForkSeed
from decode_service.worker_batch import WorkerBatch


@dataclass(frozen=True)
class Forward:
    """`worker.forward(batch)`: a decode or EAGLE step. Every rank gathers the full logits and samples
    the same tokens, so each rank's FutureMap stays identical. Sent without its fence: each rank arms
    its own."""

    batch: WorkerBatch


@dataclass(frozen=True)
class WriteKvChunk:
    """A handed-over KV chunk into the reserved slots: K and V [layers, tokens, KV heads, head_dim],
    the target's cut to the KV heads the receiving rank holds (the EAGLE head's, `draft`, whole)."""

    kv_slots: torch.Tensor
    token_start: int
    layer_start: int
    k: torch.Tensor
    v: torch.Tensor
    draft: bool


@dataclass(frozen=True)
class WritePrebuilt:
    """A prebuilt request's writes: its req_to_token row, the KV its record carries (cut the same way)
    and its FutureMap seeds."""

    req_pool_idx: int
    kv_slots: torch.Tensor
    handoff: Handoff
    fork: ForkSeed | None = None  # a forked sample's own last prompt slot (the head is whole on every rank)


@dataclass(frozen=True)
class ExtendRow:
    """A row grown on demand: positions `start`.. map to `slots` (kv_growth.py)."""

    req_pool_idx: int
    start: int
    slots: torch.Tensor


@dataclass(frozen=True)
class ReleaseRow:
    """A released row's consume-once guard cleared."""

    req_pool_idx: int


@dataclass(frozen=True)
class Stop:
    """The service is stopping: the follower returns."""


DecodeTPMessage = Forward | WriteKvChunk | WritePrebuilt | ExtendRow | ReleaseRow | Stop
