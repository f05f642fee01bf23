"""Tensor parallelism for the prefill service: every rank runs the same PrefillWorker on its part of
the model, driven by rank 0's calls, so their forwards (and collectives) pair up.

Lifecycle (prefill service with --tp-size N):
  1. every rank loads its shard and warms up; rank 0 serves gRPC and runs the scheduler with a
     TPPrefillWorker, ranks 1..N-1 run `follow` (started by common/parallel/launch.py);
  2. each worker call that changes state is broadcast first, then run on rank 0, as a message of
     tp_messages.py: Admit(request), Abort(rid), FailAll(), Step(), Stop(). The worker's bookkeeping
     is deterministic, so every rank holds the same slots, rows and radix cache;
  3. in a step that completes prompts, every rank copies out its KV heads and one all-gather builds
     the whole KV on each (`tp_shard.gather_kv_heads`): rank 0 hands it over as a TP 1 prefill would,
     so a decode service of any TP size takes it (each decode rank keeps its own heads); MLA's
     latent is the same on every rank and is taken from rank 0 as it is, with no all-gather;
  4. a call that raises on rank 0 raises on every rank (same inputs, same code): followers log it
     and wait for the next call, as rank 0's scheduler recovers (fail_all) or dies;
  5. a follower that dies fails the next collective on rank 0 (the step raises, the scheduler dies,
     health says NOT_SERVING); `mark_dead` makes rank 0 refuse at once, before any collective.
Read-only calls (`validate`, `can_admit`, integrity checks) run on rank 0 alone.
"""

from __future__ import annotations

import logging

from common.engine.handoff import HandoffRequest
from common.parallel.tp_group import TPGroup
from prefill_service.tp_messages import Abort, Admit, FailAll, PrefillTPMessage, Step, Stop
from prefill_service.worker import PrefillWorker

log = logging.getLogger(__name__)


class TPPrefillWorker(PrefillWorker):
    """Rank 0's worker: every state change broadcast to the follower ranks first."""

    def __init__(self, runner, tp: TPGroup, chunk_size: int = 256, radix_cache: bool = True, staging="cpu"):
        super().__init__(runner, chunk_size, radix_cache, staging)
        self.tp = tp
        self.dead: str | None = None

    def mark_dead(self, reason: str) -> None:
        self.dead = reason

    def _send(self, message: PrefillTPMessage) -> None:
        if self.dead is not None:
            raise RuntimeError(self.dead)
        self.tp.broadcast_object(message)

    def admit(self, request: HandoffRequest) -> None:
        """Rank 0's scheduler checked it at submit: every rank reserves the same slots."""
        self._send(Admit(request))
        super().admit(request)

    def abort(self, request: HandoffRequest) -> bool:
        if not any(w.request is request for w in self.running):
            return False
        self._send(Abort(request.rid))
        return super().abort(request)

    def fail_all(self) -> list[HandoffRequest]:
        if self.dead is None:
            self.tp.broadcast_object(FailAll())
        return super().fail_all()

    def step(self, on_first_token=None):
        self._send(Step())
        return super().step(on_first_token)

    def stop_followers(self) -> None:
        try:
            self._send(Stop())
        except Exception as e:  # noqa: BLE001 (a follower already gone)
            log.warning("TP followers not stopped cleanly: %s", e)


def follower_main(config, tp: TPGroup) -> None:
    """A follower rank of the prefill service (common/parallel/launch.py starts it)."""
    from common.engine.model_runner import ModelRunner

    runner = ModelRunner.for_service(config, tp)
    # a follower's handoffs go nowhere (rank 0 sends the KV): they stay where the pool is, no host copy
    follow(PrefillWorker(runner, config.chunked_prefill_size, not config.disable_radix_cache, runner.device), tp)


def follow(worker: PrefillWorker, tp: TPGroup) -> None:
    """Run rank 0's worker calls until it says stop (or dies: the broadcast raises)."""
    while not isinstance(message := tp.broadcast_object(None), Stop):
        try:
            match message:
                case Admit(request=request):
                    worker.admit(request)
                case Abort(rid=rid):
                    request = next((w.request for w in worker.running if w.request.rid == rid), None)
                    if request is not None:
                        worker.abort(request)
                case FailAll():
                    worker.fail_all()
                case Step():
                    worker.step()  # the handoffs are rank 0's to send
                case _:
                    raise TypeError(f"unknown TP message {message!r:.80}")
        except Exception:  # noqa: BLE001 (rank 0 met the same error and handles it)
            log.exception("TP follower: %s failed (as on rank 0)", type(message).__name__)
