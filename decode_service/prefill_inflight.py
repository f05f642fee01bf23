"""The prefill client's requests in flight: one `InFlight` record per request, from the scheduler's call
until its handoff is delivered or failed, and the progress watchdog over their attempts.

Only the scheduler cancels (it calls the client, then cancels what it called for: decode_service/
scheduler.py), so a cancel never comes before its request began; one for a request whose run has
ended does nothing. Each attempt registers
its gRPC call (`attach`) so a cancel, the watchdog or close() can cancel it; once its first message
is in, an attempt that sends nothing for `progress_timeout_s` is cancelled by the watchdog and marked
stalled, so the retry can say why it broke.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class InFlight:
    """One request between the client's call and the end of its run."""

    cancelled: bool = False  # by the front door, or by close(): no retry
    stalled: bool = False  # the watchdog cancelled its current attempt
    call: object | None = None  # the current attempt's gRPC call (a grpc.Future), None between attempts
    replica: object | None = None  # the replica that attempt streams from (prefill_replicas.Replica)
    last_message: float | None = None  # monotonic time of the attempt's last message; None before the first


class InFlightCalls:
    def __init__(self):
        self._requests: dict[str, InFlight] = {}
        self._lock = threading.Lock()

    def begin(self, rid: str) -> None:
        with self._lock:
            self._requests.setdefault(rid, InFlight())

    def end(self, rid: str) -> None:
        with self._lock:
            self._requests.pop(rid, None)

    def cancel(self, rid: str) -> None:
        with self._lock:
            state = self._requests.get(rid)
            if state is None:  # its run has ended: nothing to cancel
                return
            state.cancelled = True
            call = state.call
        if call is not None:
            call.cancel()

    def cancel_all(self) -> None:
        """Every request cancelled (no retries), every attempt's call with it."""
        with self._lock:
            for state in self._requests.values():
                state.cancelled = True
            calls = [s.call for s in self._requests.values() if s.call is not None]
        for call in calls:
            call.cancel()

    def attach(self, rid: str, call, replica) -> None:
        """An attempt's call started: cancelled at once if its request already is."""
        with self._lock:
            state = self._requests.setdefault(rid, InFlight())
            state.call, state.replica, state.last_message = call, replica, None
            if state.cancelled:
                call.cancel()

    def detach(self, rid: str) -> None:
        """The attempt ended: nothing of it is watched or cancelled any more."""
        with self._lock:
            state = self._requests.get(rid)
            if state is not None:
                state.call = state.replica = state.last_message = None

    def progress(self, rid: str) -> None:
        """The attempt sent a message."""
        with self._lock:
            state = self._requests.get(rid)
            if state is not None and state.call is not None:
                state.last_message = time.monotonic()

    def broke(self, rid: str) -> tuple[bool, bool]:
        """(cancelled, stalled) for a request whose attempt just broke; the stall mark is taken."""
        with self._lock:
            state = self._requests.get(rid)
            if state is None:
                return False, False
            stalled, state.stalled = state.stalled, False
            return state.cancelled, stalled

    def replica_of(self, rid: str):
        """The replica the request's current attempt streams from, or None."""
        with self._lock:
            state = self._requests.get(rid)
            return state.replica if state is not None and state.call is not None else None

    def watch(self, closed: threading.Event, progress_timeout_s: float) -> None:
        """A daemon thread cancels, until `closed`, every attempt silent for `progress_timeout_s` since
        its last message."""
        threading.Thread(
            target=self._watchdog, args=(closed, progress_timeout_s), name="prefill-watchdog", daemon=True
        ).start()

    def _watchdog(self, closed: threading.Event, timeout: float) -> None:
        while not closed.wait(min(0.25, timeout / 4)):
            now = time.monotonic()
            with self._lock:
                stale = [
                    s
                    for s in self._requests.values()
                    if s.call is not None and s.last_message is not None and now - s.last_message > timeout
                ]
                for s in stale:
                    s.stalled = True
                calls = [s.call for s in stale]
            for call in calls:
                call.cancel()
