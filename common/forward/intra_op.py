"""Torch intra-op threads on CPU: one thread per process computes with several, the rest with one.

torch's CPU ops run their parallel regions (and MKL's) on OpenMP. GNU libgomp keeps a pool of worker
threads for every thread that ever ran a region with more than one thread, until that thread exits.
Once the pools' workers outnumber the cores, libgomp stops spin-waiting between regions (a worker
sleeps after ~100 spins instead of ~300k) and every region pays a futex wake-up. A decode forward has
~150 regions: on the 2-core dev machine a SmolLM2-135M batch-1 decode forward took 16 ms with one
pool alive and 24-25 ms with two (a 4-token verify 23 ms and 31-35 ms).

So each process has one computing thread with the configured count (the decode forward stream's
worker, the prefill scheduler's thread; the calling thread for offline tools that compute in place),
and everything else that may touch a large tensor runs single-threaded: model loading and warm-up
(`single_threaded`), gRPC handler and call threads (`pin_single` as their initializer), and an
in-process prefill stand-in beside a decode stream. Only speed depends on this, never results.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")
_held = threading.local()  # the count a computing thread was started with (thread_target)


def held_threads() -> int | None:
    """The calling thread's computing count if it is a computing thread (thread_target), else None."""
    return getattr(_held, "threads", None)


def pin(threads: int) -> None:
    """Give the calling thread `threads` intra-op threads, fixed: torch initialises a thread's count
    lazily from the process-wide default on its first parallel op, so the read here settles it now
    and a later `torch.set_num_threads` on another thread cannot reach this one."""
    torch.set_num_threads(threads)
    torch.get_num_threads()


def hold(threads: int) -> bool:
    """Set the calling computing thread's count back to `threads` where something changed it; True
    if it had to. Seen in the decode service (2026-11-26): at its first decode step the forward
    stream's count fell from 2 to 1 and every later step ran on one core (a batch-64 step 425-496 ms
    against 290 ms in one process). The cause: a library compiled against ATen (the fused CPU ops)
    carries its own copy of ATen's lazy per-thread count set-up, whose first parallel call on a
    thread re-reads torch's process-wide count, i.e. the last `torch.set_num_threads` of any thread
    (1, from `pin_single` in the helper pools). The fused ops no longer use that set-up
    (common/kernels/cpu_fused.cpp); this check stays as a guard against any other such library (a
    read of a thread-local per piece of work, far below a microsecond)."""
    if torch.get_num_threads() == threads:
        return False
    pin(threads)
    return True


def pin_single() -> None:
    """A thread pool's initializer: its threads never start an OpenMP pool."""
    pin(1)


@contextmanager
def single_threaded():
    """Run a block (model loading, warm-up) on one intra-op thread, so the calling thread starts no
    OpenMP pool there; its count is restored after."""
    threads = torch.get_num_threads()
    pin(1)
    try:
        yield
    finally:
        pin(threads)


def thread_target(fn: Callable[[], T], threads: int | None = None) -> Callable[[], T]:
    """A thread's target that pins `threads` intra-op threads (default: the count of the thread
    building it, i.e. the configured one) and then runs fn: the process's computing thread."""
    threads = threads or torch.get_num_threads()

    def run() -> T:
        pin(threads)
        _held.threads = threads
        return fn()

    return run


def on_own_thread(fn: Callable[[], T], threads: int | None = None) -> T:
    """fn() on a new thread with the caller's intra-op thread count, and its result (or exception):
    the OpenMP pool it starts ends with it, so computing on the main thread of a process that also
    runs a forward stream (a benchmark's HF baseline) leaves no second pool behind."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e

    worker = threading.Thread(target=thread_target(run, threads), name="own-pool")
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
