"""One launched decode step as the scheduler tracks it, the scheduler's test hooks, and its error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from decode_service.req import DecodeReq


class InvariantError(AssertionError):
    """A scheduler invariant was broken (a bug, not a user error)."""


@dataclass
class StepResult:
    """One launched decode step: who was in it and where its sampled tokens land."""
    step: int
    reqs: list[DecodeReq]
    results_ready: object
    seq_lens: torch.Tensor           # the mirror tensor the forward reads
    seq_lens_version: int
    tokens_cpu: torch.Tensor | None = None      # [B], or EAGLE's [B, S+1]
    accepted_cpu: torch.Tensor | None = None    # EAGLE: accepted drafts per request [B]


@dataclass
class SchedulerHooks:
    """Test hooks: called on the scheduler thread (after_launch) or the stream (before_forward)."""
    after_launch: Callable[[int], None] | None = None
    before_forward: Callable[[int], None] | None = None
    propose: Callable | None = None  # EAGLE: ([(rid, prompt_len)], seq_lens_cpu, drafts [B, S]) -> drafts to verify
    # EAGLE tree: ([(rid, prompt_len)], seq_lens_cpu, node tokens, parent, depth [B, M]) -> node tokens to verify
    propose_tree: Callable | None = None
