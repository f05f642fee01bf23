"""InProcessPrefill: a PrefillScheduler in this process, called like a remote prefill replica.

The decode scheduler calls it with a HandoffRequest after reserving the request's slots; it submits
a PrefillCall to the same scheduler the prefill service runs (scheduler.py: inbox -> waiting ->
running, chunked steps, short prompts first, one answer per call) and hands each answer to the
callbacks: a Handoff to `deliver`, an error to `fail(rid, reason)`. The first token is not sent
ahead: the Handoff carries it. The gRPC client replaces this between processes; tests and benchmarks
use it in one process. It stands in for another process beside a decode stream that computes here,
so the scheduler's thread has one intra-op thread (a second OpenMP pool would slow every parallel
region of the decode forward: common/forward/intra_op.py).
"""

from __future__ import annotations

from collections.abc import Callable

from common.engine.handoff import Handoff, HandoffRequest
from prefill_service.scheduler import Answer, PrefillCall, PrefillScheduler
from prefill_service.worker import PrefillWorker


class InProcessPrefill:
    def __init__(
        self,
        worker: PrefillWorker,
        deliver: Callable[[Handoff], None],
        fail: Callable[[str, str], None],
        max_batch: int = 16,
    ):
        """`max_batch`: prompts prefilled together at most (the scheduler's max_running_requests)."""
        self.worker = worker
        self.deliver, self.fail = deliver, fail
        self.scheduler = PrefillScheduler(worker, max_running_requests=max_batch).start(threads=1)

    def __call__(self, request: HandoffRequest) -> None:
        try:
            self.scheduler.submit(PrefillCall(request, lambda answer: self._answer(request.rid, answer)))
        except ValueError as e:  # the prompt does not suit this prefill's pool: the request's error
            self._answer(request.rid, e)

    def close(self) -> None:
        """Stop the scheduler; a call not answered yet fails ("prefill service stopping")."""
        self.scheduler.stop(timeout=30)

    def _answer(self, rid: str, answer: Answer) -> None:
        if isinstance(answer, Exception):  # the decode side frees the request's reservation
            self.fail(rid, f"prefill failed: {answer}")
        else:
            self.deliver(answer)
