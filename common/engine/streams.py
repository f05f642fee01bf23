"""Streams and events: where forward work runs, and how the schedule side learns it is done.

One interface, two implementations:
- CUDA: `DeviceStream` wraps a torch.cuda.Stream; `submit(fn)` runs fn on the host at once inside
  that stream's context, so its kernels queue on the stream and the host returns while they run.
  `DeviceEvent` wraps torch.cuda.Event.
- CPU: `WorkerStream` is one forward worker thread that runs submitted work strictly in submission
  order, with the creator's intra-op thread count (the process's computing thread, intra_op.py);
  `HostEvent` is a thread-safe flag. So overlap is real on CPU, and the scheduler code is the
  same on both.

The event contract, the same on both (docs/architecture.md, FutureMap invariant 3):
- `set_here()` is called *inside* stream work: the event is reached when the stream gets there.
  On CUDA that records the event on the stream while the host launches the work, so the record
  always happens before `submit` returns; on CPU the flag was created unset (armed) by
  `make_event()` and the worker sets it when it runs that point.
- Nobody waits on an event whose work has not been submitted: a fresh `torch.cuda.Event` reads as
  already reached until its first record, so "armed, unset" exists only while its work is queued.
- A failed stream never reaches its later events. An exception raised by submitted work is kept;
  the CPU stream then skips ordinary work (signals still run) and refuses new work, and
  `wait_event` re-raises the error to every waiter instead of letting it wait forever.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from common.forward import intra_op

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiter re-checks a stream for failure (the event itself wakes it at once)


class StreamFailed(RuntimeError):
    """Work on a stream raised; every later wait on that stream raises this."""


class HostEvent:
    def __init__(self):
        self._flag = threading.Event()

    def record(self, stream: WorkerStream) -> None:
        stream.submit_signal(self._flag.set)

    def set_here(self) -> None:
        """Called from inside stream work: the point is reached now."""
        self._flag.set()

    def wait_here(self) -> None:
        """Called from inside stream work: block this stream until the event is reached."""
        self._flag.wait()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._flag.wait(timeout):
            raise TimeoutError("event not reached within timeout")


class WorkerStream:
    """A CPU 'stream': one daemon thread running submitted callables in order."""

    def __init__(self, name: str = "forward"):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        # the process's computing thread, with the creator's intra-op thread count (intra_op.py)
        self._threads, self._restored = torch.get_num_threads(), 0  # its computing count, and how often restored
        target = intra_op.thread_target(self._loop, self._threads)
        self._thread = threading.Thread(target=target, name=f"{name}-stream", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, is_signal = item
            if self._error is not None and not is_signal:
                continue  # after a failure only event signals run, so `record`ed events still fire
            if intra_op.hold(self._threads):
                self._restored += 1
                if self._restored == 1:  # said once: the count was changed under this thread
                    log.info("forward stream: its intra-op thread count had changed; set back to %d", self._threads)
            try:
                fn()
            except BaseException as e:  # surfaced to the schedule side
                self._error = e

    def submit(self, fn: Callable[[], object]) -> None:
        self.raise_if_failed()
        self._queue.put((fn, False))

    def submit_signal(self, fn: Callable[[], object]) -> None:
        """Queue an event signal: it runs in order, and also after a failure (so waiters wake)."""
        self._queue.put((fn, True))

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise StreamFailed(f"forward stream failed: {self._error!r}") from self._error

    def synchronize(self, timeout: float | None = None) -> None:
        done = HostEvent()
        done.record(self)
        wait_event(done, self, timeout)
        self.raise_if_failed()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


class DeviceEvent:
    def __init__(self):
        self._event = torch.cuda.Event()

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self, timeout: float | None = None) -> None:
        if timeout is None:
            self._event.synchronize()  # blocks in the driver with the GIL released
            return
        poll_until(self._event.query, timeout)

    def set_here(self) -> None:
        self._event.record(torch.cuda.current_stream())

    def wait_here(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)


class DeviceStream:
    """Work submitted here first waits for what the submitting (schedule) stream queued before it, so
    tensors the scheduler just built are ready; each work item (and the tensors its closure holds) is
    kept alive until the stream has passed it, so the caching allocator cannot hand its memory out
    while kernels still read it."""

    def __init__(self, device: torch.device, name: str = "forward"):
        self.stream = torch.cuda.Stream(device=device)
        self._in_flight: deque = deque()  # (event, fn) pairs not yet passed by the stream

    def submit(self, fn: Callable[[], object]) -> None:
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        self._in_flight.append((done, fn))

    def raise_if_failed(self) -> None:
        pass  # a failed kernel surfaces as an exception from the next synchronize or query

    def synchronize(self, timeout: float | None = None) -> None:
        done = DeviceEvent()
        with torch.cuda.stream(self.stream):
            done.set_here()
        done.synchronize(timeout)

    def close(self) -> None:
        self.stream.synchronize()


def poll_until(query: Callable[[], bool], timeout: float, first_pause: float = 50e-6, max_pause: float = 2e-3) -> None:
    """Poll `query` until it is true, sleeping 50 us, then twice as long each time up to 2 ms (a
    short wait stays short, a long one costs few wake-ups); TimeoutError after `timeout` seconds."""
    deadline, pause = time.monotonic() + timeout, first_pause
    while not query():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("event not reached within timeout")
        time.sleep(min(pause, left))
        pause = min(pause * 2, max_pause)


def wait_event(event, stream, timeout: float | None = None) -> None:
    """Wait until `event` is reached; raise StreamFailed if `stream` failed first (its later events
    may never be reached), TimeoutError after `timeout` seconds. A CUDA stream's failure surfaces
    as an exception from the wait itself, so there the event is waited on in one call."""
    if isinstance(stream, DeviceStream):
        event.synchronize(timeout)
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        stream.raise_if_failed()
        wait = POLL_S if deadline is None else min(POLL_S, max(deadline - time.monotonic(), 0.0))
        try:
            event.synchronize(wait)
            return
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                stream.raise_if_failed()
                raise


def make_stream(device: torch.device | str, name: str = "forward"):
    device = torch.device(device)
    return DeviceStream(device, name) if device.type == "cuda" else WorkerStream(name)


def make_event(device: torch.device | str):
    """An armed (unset) event of the right kind for `device`."""
    return DeviceEvent() if torch.device(device).type == "cuda" else HostEvent()
