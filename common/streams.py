"""Streams and events: where forward work runs, and how the schedule side learns it is done.

One interface, two implementations:
- CUDA: `DeviceStream` wraps a torch.cuda.Stream; `submit(fn)` runs fn on the host at once inside
  that stream's context, so its kernels queue on the stream and the host returns while they run.
  `DeviceEvent` wraps torch.cuda.Event.
- CPU: `WorkerStream` is one forward worker thread that runs submitted work strictly in submission
  order; `HostEvent` is a thread-safe flag. So overlap is real on CPU, and the scheduler code is the
  same on both.

`Event.record(stream)` marks the point after all work submitted to that stream so far; on CPU the
event must be *armed* (created unset) first, which `make_event()` does. An exception raised by
submitted work is kept and re-raised to the schedule side at the next `synchronize()` or
`raise_if_failed()`, and the stream refuses further work.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable

import torch


class HostEvent:
    def __init__(self):
        self._flag = threading.Event()

    def record(self, stream: "WorkerStream") -> None:
        stream.submit(self._flag.set)

    def set(self) -> None:
        self._flag.set()

    set_here = set  # called from inside stream work: the point is reached now

    def wait_here(self) -> None:
        """Called from inside stream work: block this stream until the event is reached."""
        self._flag.wait()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._flag.wait(timeout):
            raise TimeoutError("event not reached within timeout")

    def wait_on(self, stream: "WorkerStream") -> None:
        """Make later work on `stream` start only after this event (cross-stream chaining)."""
        stream.submit(self._flag.wait)


class WorkerStream:
    """A CPU 'stream': one daemon thread running submitted callables in order."""

    def __init__(self, name: str = "forward"):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"{name}-stream", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            if self._error is not None and fn.__name__ != "set":
                continue  # after a failure only event signals run, so waiters wake up
            try:
                fn()
            except BaseException as e:  # surfaced to the schedule side
                self._error = e

    def submit(self, fn: Callable[[], object]) -> None:
        self.raise_if_failed()
        self._queue.put(fn)

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"forward stream failed: {self._error!r}") from self._error

    def synchronize(self, timeout: float | None = None) -> None:
        done = HostEvent()
        done.record(self)
        done.synchronize(timeout)
        self.raise_if_failed()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


class DeviceEvent:
    def __init__(self):
        self._event = torch.cuda.Event()

    def record(self, stream: "DeviceStream") -> None:
        self._event.record(stream.stream)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self, timeout: float | None = None) -> None:
        if timeout is None:
            self._event.synchronize()
            return
        deadline = time.monotonic() + timeout
        while not self._event.query():
            if time.monotonic() >= deadline:
                raise TimeoutError("event not reached within timeout")
            time.sleep(0.0005)

    def wait_on(self, stream: "DeviceStream") -> None:
        stream.stream.wait_event(self._event)

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
        pass

    def synchronize(self, timeout: float | None = None) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.synchronize()


def make_stream(device: torch.device | str, name: str = "forward"):
    device = torch.device(device)
    return DeviceStream(device, name) if device.type == "cuda" else WorkerStream(name)


def make_event(device: torch.device | str):
    """An armed (unset) event of the right kind for `device`."""
    return DeviceEvent() if torch.device(device).type == "cuda" else HostEvent()
