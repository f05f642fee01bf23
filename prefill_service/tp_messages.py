"""The messages rank 0's prefill worker broadcasts to its TP followers (tp_worker.py), one per state
change, in the order rank 0 runs them. Plain frozen dataclasses made of fields only: the TP codec
(common/parallel/tp_codec.py, MESSAGE_TYPES) carries them, and a follower dispatches by type.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.engine.handoff import HandoffRequest


@dataclass(frozen=True)
class Admit:
    """`worker.admit(request)`: rank 0 validated it; every rank reserves the same slots."""

    request: HandoffRequest


@dataclass(frozen=True)
class Abort:
    """`worker.abort` of the running request with this rid (its call was cancelled)."""

    rid: str


@dataclass(frozen=True)
class FailAll:
    """`worker.fail_all()`: free every running request (a failed step, or the scheduler closing)."""


@dataclass(frozen=True)
class Step:
    """`worker.step()`: one chunked extend forward; its collectives pair up with rank 0's."""


@dataclass(frozen=True)
class Stop:
    """The service is stopping: the follower returns."""


PrefillTPMessage = Admit | Abort | FailAll | Step | Stop
