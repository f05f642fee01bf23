"""The decode scheduler's inbox: what other threads post, and the loop applies between steps.

Posted by the front door (Submit, Abort) and the prefill side (FirstTokenArrived, KvChunkArrived,
HandoffArrived, HandoffFailed: `Inbox` is the sink a PrefillClient or an in-process prefill delivers
to). The scheduler drains it at the top of each step and dispatches each message by its type, in the
order posted, so an Abort can never overtake the Submit it names.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from common.engine.handoff import Handoff
from common.request_rules import ErrorKind
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
    """K/V of tokens token_start.. for layers layer_start.. (each [layers, tokens, kv_heads, head_dim]);
    written into reserved slots."""

    rid: str
    token_start: int
    layer_start: int
    k: torch.Tensor
    v: torch.Tensor
    draft: bool = False  # the EAGLE head's KV (its one layer) instead of the target's
    done: Callable[[], None] | None = None  # called once the chunk is written or dropped (flow control)


@dataclass
class HandoffArrived:
    handoff: Handoff

    @property
    def rid(self) -> str:
        return self.handoff.rid


@dataclass
class HandoffFailed:
    rid: str
    error: str
    kind: ErrorKind = ErrorKind.BROKEN


InboxMessage = Submit | Abort | FirstTokenArrived | KvChunkArrived | HandoffArrived | HandoffFailed


def once(fn: Callable[[], None] | None) -> Callable[[], None] | None:
    """`fn` made safe to call more than once (it runs the first time only): a chunk's flow-control
    release, which a failure path may call after the stream did."""
    if fn is None:
        return None
    lock, called = threading.Lock(), []

    def call() -> None:
        with lock:
            if called:
                return
            called.append(True)
        fn()

    return call


class Inbox:
    """A thread-safe queue of InboxMessages and the event that wakes an idle scheduler."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self.wake = threading.Event()

    def post(self, msg: InboxMessage) -> None:
        self._queue.put(msg)
        self.wake.set()

    def drain(self) -> Iterator[InboxMessage]:
        """Every message posted so far, oldest first (also those posted while draining)."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def empty(self) -> bool:
        return self._queue.empty()

    # ---- the prefill side's sink -----------------------------------------------------------------
    def deliver_first_token(self, rid: str, token: int, position: int = 0) -> None:
        self.post(FirstTokenArrived(rid, token, position))

    def deliver_kv(
        self,
        rid: str,
        token_start: int,
        layer_start: int,
        k: torch.Tensor,
        v: torch.Tensor,
        draft: bool = False,
        done=None,
    ) -> None:
        self.post(KvChunkArrived(rid, token_start, layer_start, k, v, draft, once(done)))

    def deliver_handoff(self, handoff: Handoff) -> None:
        self.post(HandoffArrived(handoff))

    def fail_handoff(self, rid: str, error: str, kind: ErrorKind = ErrorKind.BROKEN) -> None:
        self.post(HandoffFailed(rid, error, kind))
