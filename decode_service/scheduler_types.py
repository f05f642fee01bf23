"""One launched decode step as the scheduler tracks it, EAGLE's running totals, and the scheduler's error."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode_service.req import DecodeReq
from decode_service.worker_batch import BatchResult


class InvariantError(AssertionError):
    """A scheduler invariant was broken (a bug, not a user error)."""


@dataclass
class LaunchedStep:
    """A step whose forward was submitted: who rode in it and where its results land."""

    reqs: list[DecodeReq]
    result: BatchResult
    kv_committed_lens: torch.Tensor  # the mirror tensor the forward reads: nobody may change it in place
    kv_committed_lens_version: int


@dataclass
class SpecStats:
    """EAGLE since start, over every request: drafts accepted and drafts proposed."""

    accepted: int = 0
    drafted: int = 0

    def __iter__(self):
        return iter((self.accepted, self.drafted))
