"""The decode scheduler's inbox messages: what other threads post, and the loop applies between steps.

Posted by the front door (Submit, Abort), the prefill peer (FirstTokenArrived, KvChunkArrived,
HandoffArrived, HandoffFailed). Each is applied by `DecodeScheduler._recv` on the scheduler thread,
in the order posted, so an Abort can never overtake the Submit it names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.handoff import Handoff
from decode_service.req import DecodeReq


@dataclass
class Submit:
    req: DecodeReq


@dataclass
class Abort:
    rid: str


@dataclass
class FirstTokenArrived:
    """A token sampled by prefill (output index `position`), streamed before the handoff completes."""
    rid: str
    token: int
    position: int


@dataclass
class KvChunkArrived:
    """K/V of tokens token_start.. for layers layer_start..; written into reserved slots."""
    rid: str
    token_start: int
    layer_start: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    draft: bool = False     # the EAGLE head's KV (its one layer) instead of the target's


@dataclass
class HandoffArrived:
    handoff: Handoff


@dataclass
class HandoffFailed:
    rid: str
    error: str


InboxMessage = Submit | Abort | FirstTokenArrived | KvChunkArrived | HandoffArrived | HandoffFailed
