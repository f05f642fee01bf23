"""DecodeReq: one request as the decode scheduler sees it, from submission to release."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from common.engine.sampling import SamplingParams
from common.request_rules import ErrorKind
from decode_service.output import OutputCallback


class ReqState(enum.Enum):
    """Where a request stands in the scheduler. Finishing is not a state: a request is `finished` once
    it has a finish_reason, which an aborted request awaiting its handoff may have long before it is
    RELEASED (a transfer engine may still write into its slots)."""

    WAITING = "waiting"  # admission queue: nothing reserved yet
    AWAITING_HANDOFF = "awaiting"  # slot + KV reserved, prefill in flight
    PREBUILT = "prebuilt"  # handoff received, joins the next prebuilt batch
    RUNNING = "running"  # in the running batch
    RELEASED = "released"  # slot and KV freed (exactly once); out of the scheduler's table


@dataclass
class DecodeReq:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    on_output: OutputCallback | None = None
    state: ReqState = ReqState.WAITING
    req_pool_idx: int = 0
    kv_slots: torch.Tensor | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # detail when finish_reason == "error"
    error_kind: ErrorKind = ErrorKind.BROKEN  # and what it was (common/request_rules.py)
    handoff: object = None  # the Handoff while PREBUILT
    spec_accepted: int = 0  # EAGLE: drafts accepted / proposed for this request
    spec_drafted: int = 0
    stop_scan: tuple = (0, 0, "")  # stop strings' incremental detokenization: (prefix, read, tail) (stop_strings.py)
    matched_stop_str: str | None = None
    held_first: bool = False  # the early first token is held back until the record brings its logprobs
    cached_tokens: int = 0  # prompt tokens the prefill side took from its prefix cache (from the handoff)
    index: int = 0  # n > 1: which sample of its request this is (sample_group.py)
    group: object = None  # n > 1: the SampleGroup its samples share (None for n = 1)
    grammar: object = None  # its compiled grammar (from the submit check), when it has a constraint
    trace: tuple | None = None  # (parent span context, submission ns) from the front door; opaque here
    submitted_at: float = field(default_factory=time.monotonic)
    retractions: int = 0  # times retracted to free KV (kv_growth.py); it then comes back without its group
    prefix_len: int = 0  # leading prompt positions whose KV came from decode's prefix cache (prefix_cache.py)
    prefix_node: object = None  # the cache node it locks while it lives
    whole_prompt: bool = False  # a prefill replica refused its handoff from the cached prefix: admitted again
    # without decode's cache, it asks for the KV of the whole prompt (scheduler.refetch_whole)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        """The request has its finish_reason (SGLang's Req.finished()); its slots may still be held."""
        return self.finish_reason is not None
