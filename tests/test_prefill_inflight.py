"""The prefill client's requests in flight (decode_service/prefill_inflight.py), without a replica:
a cancel reaches only a request that began (the scheduler cancels what it started; nothing is
remembered for later), an attempt of a cancelled request is cancelled as it starts, and the watchdog
cancels only an attempt that went silent after a message."""

from __future__ import annotations

import threading
import time

from decode_service.prefill_inflight import InFlightCalls


class _Call:
    def __init__(self):
        self.cancelled = 0

    def cancel(self):
        self.cancelled += 1


def test_a_cancel_reaches_a_begun_request_and_nothing_is_remembered_for_others():
    calls, call = InFlightCalls(), _Call()
    calls.cancel("a")  # not begun (or already ended): nothing to cancel, nothing kept
    calls.begin("a")
    calls.attach("a", call, "replica")
    assert call.cancelled == 0 and calls.broke("a") == (False, False)
    calls.cancel("a")
    assert call.cancelled == 1 and calls.broke("a") == (True, False)
    calls.end("a")
    calls.begin("a")
    assert calls.broke("a") == (False, False)


def test_cancel_reaches_the_current_attempt_and_peer_of_follows_it():
    calls, call = InFlightCalls(), _Call()
    calls.begin("a")
    assert calls.replica_of("a") is None
    calls.attach("a", call, "replica-1")
    assert calls.replica_of("a") == "replica-1"
    calls.cancel("a")
    assert call.cancelled == 1
    calls.detach("a")
    assert calls.replica_of("a") is None
    calls.cancel("a")  # between attempts: nothing to cancel, the request stays cancelled
    assert call.cancelled == 1 and calls.broke("a") == (True, False)


def test_the_watchdog_cancels_a_silent_attempt_only_after_its_first_message():
    calls, closed = InFlightCalls(), threading.Event()
    quiet, silent = _Call(), _Call()
    calls.begin("quiet")
    calls.attach("quiet", quiet, "p")  # no message yet: not watched
    calls.begin("silent")
    calls.attach("silent", silent, "p")
    calls.progress("silent")
    calls.watch(closed, 0.2)
    try:
        deadline = time.monotonic() + 5
        while not silent.cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert silent.cancelled and not quiet.cancelled
        assert calls.broke("silent") == (False, True)
        assert calls.broke("silent") == (False, False)  # the mark is taken once
    finally:
        closed.set()


def test_cancel_all_marks_every_request_and_cancels_its_attempt():
    calls, call = InFlightCalls(), _Call()
    calls.begin("a")
    calls.begin("b")
    calls.attach("a", call, "p")
    calls.cancel_all()
    assert call.cancelled == 1
    assert calls.broke("a") == (True, False) and calls.broke("b") == (True, False)
