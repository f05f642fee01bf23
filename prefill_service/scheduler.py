"""PrefillScheduler: the prefill service's loop: admission, chunked prefill steps, one answer per call.

Life of a call (queues named as in the code):
  1. submit(call): any thread hands in a validated PrefillCall; it goes on `inbox` and into
     `pending` (every call not answered yet, cancelled ones too until the loop drops them). With
     `max_pending` calls pending already, submit raises QueueFull (the server: RESOURCE_EXHAUSTED).
     After the loop has ended (stop, or a crash) a call is answered at once with the reason instead.
  2. process_input_requests(): the loop moves everything on `inbox` to `waiting` (arrival order).
  3. drop_cancelled(): one look at `call.cancelled` per call and stage: a cancelled call in
     `waiting` is answered "cancelled before prefill"; one in `running` is aborted (worker.abort
     frees its slots) and answered "cancelled during prefill".
  4. get_new_batch(): from the head of `waiting`, in order, while fewer than max_running_requests
     run and worker.can_admit says a request slot and KV for the prompt are free, admit to `running`
     (worker.admit reserves them); nothing running and the head still does not fit: it never will,
     so it is answered with an error.
  5. run_batch(): one worker step: one chunked extend forward across `running`, short prompts first
     (worker.py); process_batch_result(): each prompt completed in the step is answered with its
     Handoff (the worker already freed its slots); a failed step frees and fails every running call.
  6. stop(): the loop ends after the current step; every call still in `inbox`, `waiting` or
     `running` is answered "prefill service stopping" and the worker frees their slots.
  7. an exception escaping the loop body (outside the step's own try) ends the loop the same way,
     every pending call answered with that error: `alive` turns False, `fatal_error` holds it, and
     `on_fatal(error)` tells the owner (the server reports NOT_SERVING).
Every call gets exactly one answer, `call.on_answer(Handoff | Exception)`, called on the loop's
thread (or on the thread calling submit or stop); an answer must not block.
With debug_checks the pools' integrity is checked whenever no call is running (every slot free).
`hooks` (tests, drills: hooks.py): `hooks.after_step()` runs after each worker step; None in production.
This module runs without gRPC: the server (server.py) translates RPCs into calls; in one process
(tests, benchmarks) InProcessPrefill (inprocess.py) submits them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.engine.handoff import Handoff, HandoffRequest
from common.forward import intra_op
from prefill_service.hooks import PrefillHooks
from prefill_service.worker import PrefillWorker

logger = logging.getLogger(__name__)

Answer = Handoff | Exception


class QueueFull(RuntimeError):
    """`max_pending` calls are not answered yet: retry later (the call was not taken)."""


class PrefillCall:
    """One request submitted to the scheduler, and where its one answer goes."""

    def __init__(
        self,
        request: HandoffRequest,
        on_answer: Callable[[Answer], None],
        on_first_token: Callable[[int], None] | None = None,
    ):
        """`on_first_token(token)`: the first token as soon as it is sampled, before the answer
        (which still carries it), so the caller can stream it while the KV is copied out."""
        self.request = request
        self.on_answer = on_answer
        self.on_first_token = on_first_token
        self.cancelled = threading.Event()  # set by the server when the caller goes away
        self.queued_at = time.perf_counter()
        self.started_at = 0.0
        self.finished_at = 0.0

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class PrefillBatchResult:
    """What one worker step gave: (request, Handoff) of each completed prompt, or the step's error."""

    done: list[tuple[HandoffRequest, Handoff]] = field(default_factory=list)
    error: Exception | None = None


class PrefillScheduler:
    def __init__(
        self,
        worker: PrefillWorker,
        max_running_requests: int,
        debug_checks: bool = False,
        on_fatal: Callable[[BaseException], None] | None = None,
        max_pending: int | None = None,
        hooks: PrefillHooks | None = None,
    ):
        """`max_pending`: calls not answered yet at most (None: no bound)."""
        self.worker = worker
        self.max_running_requests = max_running_requests
        self.max_pending = max_pending
        self.debug_checks = debug_checks
        self.hooks = hooks
        self.on_fatal = on_fatal
        self.inbox: deque[PrefillCall] = deque()  # submitted, not seen by the loop yet
        self.waiting: deque[PrefillCall] = deque()  # seen, waiting for slots (loop thread only)
        self.running: dict[int, PrefillCall] = {}  # id(request) -> call admitted to the worker
        self.pending: dict[int, PrefillCall] = {}  # id(call) -> every call not answered yet
        self.num_prefilled = 0  # calls answered with a Handoff since start
        self.fatal_error: BaseException | None = None
        self._cv = threading.Condition()  # guards inbox, pending, _stopping, _closed
        self._stopping = False
        self._closed: Exception | None = None  # the loop has ended: the answer to later calls
        self._thread: threading.Thread | None = None

    # ---- API (any thread) -----------------------------------------------------------------------
    def submit(self, call: PrefillCall) -> None:
        """Queue a call; ValueError (InvalidRequest) before anything is queued when its prompt or params
        do not suit this replica's model and pool (the one check: worker.validate), QueueFull when full."""
        self.worker.validate(call.request)
        with self._cv:
            closed = self._closed
            if closed is None and self.max_pending is not None and len(self.pending) >= self.max_pending:
                raise QueueFull(f"{len(self.pending)} prefill calls are queued or running (at most {self.max_pending})")
            if closed is None:
                self.pending[id(call)] = call
                self.inbox.append(call)
                self._cv.notify()
        if closed is not None:
            _guarded(call.on_answer, closed, call, "answer")

    def start(self, threads: int | None = None) -> PrefillScheduler:
        """Start the loop's thread with `threads` intra-op threads (default: the configured count, as
        the process's computing thread; 1 beside another computing thread: common/forward/intra_op.py)."""
        target = intra_op.thread_target(self._run, threads)
        self._thread = threading.Thread(target=target, name="prefill-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop after its current step; every call not answered yet is answered."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._close(RuntimeError("prefill service stopping"))  # a no-op once the loop has closed
            return
        # the loop is stuck in a step: answer what it has not seen; it answers the rest when it ends
        logger.warning("prefill scheduler still in a step after %.1fs", timeout)
        with self._cv:
            unseen = list(self.inbox)
            self.inbox.clear()
        for call in unseen:
            self._answer(call, RuntimeError("prefill service stopping"))

    @property
    def alive(self) -> bool:
        return self.fatal_error is None and (self._thread is None or self._thread.is_alive())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def num_queued(self) -> int:
        return len(self.inbox) + len(self.waiting)

    # ---- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.event_loop()
        except BaseException as e:  # noqa: BLE001 - every pending call gets this error, never a hang
            self.fatal_error = e
            logger.exception("prefill scheduler failed")
            self._close(e if isinstance(e, Exception) else RuntimeError(f"prefill scheduler ended: {e!r}"))
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        self._close(RuntimeError("prefill service stopping"))

    def event_loop(self) -> None:
        threads = intra_op.held_threads()  # the computing count this thread was started with
        while True:
            self.wait_for_work()
            if threads is not None:
                intra_op.hold(threads)  # set back if something changed it (intra_op.hold)
            stopping = self.process_input_requests()
            self.drop_cancelled()
            self.get_new_batch()
            if stopping:
                return
            if self.running:
                self.process_batch_result(self.run_batch())

    def wait_for_work(self) -> None:
        """Block while there is nothing to do (nothing submitted, waiting or running) and no stop."""
        with self._cv:
            while not (self.inbox or self.waiting or self.running or self._stopping):
                self._cv.wait()

    def process_input_requests(self) -> bool:
        """Move every submitted call to `waiting`; True when the loop is to stop."""
        with self._cv:
            self.waiting.extend(self.inbox)
            self.inbox.clear()
            return self._stopping

    def drop_cancelled(self) -> None:
        for call in list(self.waiting):
            if call.cancelled.is_set():
                self.waiting.remove(call)
                self._answer(call, RuntimeError("cancelled before prefill"))
        for key, call in list(self.running.items()):
            if call.cancelled.is_set():
                self.worker.abort(call.request)
                del self.running[key]
                self._answer(call, RuntimeError("cancelled during prefill"))

    def get_new_batch(self) -> None:
        """Admit from the head of `waiting` while the limit and the free slots allow."""
        while (
            self.waiting
            and len(self.running) < self.max_running_requests
            and self.worker.can_admit(self.waiting[0].request)
        ):
            call = self.waiting.popleft()
            self.worker.admit(call.request)  # checked at submit (worker.validate)
            call.started_at = time.perf_counter()
            self.running[id(call.request)] = call
        if self.waiting and not self.running:  # nothing running, yet the head does not fit: it never will
            self._answer(self.waiting.popleft(), RuntimeError("prompt does not fit the free KV slots"))

    def run_batch(self) -> PrefillBatchResult:
        try:
            result = PrefillBatchResult(done=self.worker.step(on_first_token=self._first_token))
        except Exception as e:  # every admitted call fails (also any the step finished before it broke)
            result = PrefillBatchResult(error=e)
        if self.hooks is not None:
            self.hooks.after_step()
        return result

    def process_batch_result(self, result: PrefillBatchResult) -> None:
        if result.error is not None:
            self.worker.fail_all()
            failed = list(self.running.values())
            self.running.clear()
            for call in failed:
                self._answer(call, result.error)
        now = time.perf_counter()
        for req, handoff in result.done:
            call = self.running.pop(id(req))
            call.finished_at = now
            self.num_prefilled += 1
            self._answer(call, handoff)
        if self.debug_checks and not self.running:  # the worker freed every slot but the cache's: the books balance
            self.worker.check_idle_integrity()

    # ---- answers --------------------------------------------------------------------------------
    def _first_token(self, request: HandoffRequest, token: int) -> None:
        call = self.running.get(id(request))
        if call is not None and call.on_first_token is not None:
            _guarded(call.on_first_token, token, call, "first token")

    def _close(self, error: Exception) -> None:
        """The loop has ended: free what the worker holds, answer every pending call with `error`."""
        with self._cv:
            if self._closed is None:
                self._closed = error
            unanswered = list(self.pending.values())
            self.inbox.clear()
        self.waiting.clear()
        self.running.clear()
        try:
            self.worker.fail_all()
        except Exception:  # noqa: BLE001 - the calls still get their answer
            logger.exception("freeing the prefill worker's requests failed")
        for call in unanswered:
            self._answer(call, error)

    def _answer(self, call: PrefillCall, result: Answer) -> None:
        with self._cv:
            known = self.pending.pop(id(call), None) is not None
        if not known:  # answered already: exactly one answer per call
            logger.error("prefill call %s answered twice; the second answer is dropped", call.request.rid)
            return
        _guarded(call.on_answer, result, call, "answer")


def _guarded(receive: Callable, value, call: PrefillCall, what: str) -> None:
    """Hand `value` to a call's receiver; a broken receiver must not stop the loop."""
    try:
        receive(value)
    except Exception:  # noqa: BLE001
        logger.exception("delivering the %s of prefill call %s failed", what, call.request.rid)
