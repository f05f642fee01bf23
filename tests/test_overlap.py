"""Overlap is real on CPU: step N+1 is built and launched while forward N is still running."""

from __future__ import annotations

import threading

import pytest

from common.engine.sampling import SamplingParams
from common.engine.streams import HostEvent, WorkerStream
from tests.decode_harness import Hooks, Pair
from tests.oracle import hf_greedy

HELD_STEP = 4


def _run_with_latch(path: str, overlap: bool, wait_s: float) -> tuple[bool, Pair]:
    """Forward HELD_STEP blocks until step HELD_STEP + 1 has been launched (or wait_s passes)."""
    latch, released = threading.Event(), []
    hooks = Hooks(
        before_forward=lambda step: step == HELD_STEP and released.append(latch.wait(wait_s)),
        after_launch=lambda step: step == HELD_STEP + 1 and latch.set(),
    )
    pair = Pair(path, overlap=overlap, hooks=hooks)
    try:
        pair.submit("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=12, ignore_eos=True))
        pair.wait(["r"])
    finally:
        pair.close()
    return released == [True], pair


def test_step_n_plus_1_is_launched_while_forward_n_runs(checkpoint):
    path = checkpoint("qwen2")
    overlapped, pair = _run_with_latch(path, overlap=True, wait_s=20)
    assert overlapped, "scheduling waited for forward N before building step N+1"
    assert pair.out.tokens["r"] == hf_greedy(path, [5, 6, 7, 8], 12)


def test_the_latch_check_fails_without_overlap(checkpoint):
    """Control: with overlap off the held forward is never released by step N+1 (it times out)."""
    overlapped, pair = _run_with_latch(checkpoint("qwen2"), overlap=False, wait_s=0.5)
    assert not overlapped
    assert len(pair.out.tokens["r"]) == 12


def test_worker_stream_runs_in_order_and_surfaces_errors():
    stream, seen = WorkerStream(), []
    for i in range(50):
        stream.submit(lambda i=i: seen.append(i))
    done = HostEvent()
    done.record(stream)
    done.synchronize(timeout=5)
    assert seen == list(range(50))

    def boom():
        raise ValueError("bad kernel")

    stream.submit(boom)
    after = HostEvent()
    after.record(stream)  # events still fire after a failure, so nobody hangs
    after.synchronize(timeout=5)
    with pytest.raises(RuntimeError, match="bad kernel"):
        stream.raise_if_failed()
    with pytest.raises(RuntimeError, match="bad kernel"):
        stream.submit(lambda: None)
    stream.close()


def test_worker_stream_survives_failing_work_without_a_name():
    """Work items need no __name__ (a functools.partial has none): after a failure the worker
    keeps running, so every waiter wakes with the error (regression: the worker thread died)."""
    import functools

    def fail(msg):
        raise ValueError(msg)

    stream, latch = WorkerStream(), threading.Event()
    stream.submit(lambda: latch.wait(5))  # hold the worker so both items queue behind it
    stream.submit(functools.partial(fail, "bad kernel"))
    stream.submit(functools.partial(print, "skipped after the failure"))
    latch.set()
    with pytest.raises(RuntimeError, match="bad kernel"):
        stream.synchronize(timeout=5)  # not TimeoutError: the worker is alive
    assert stream._thread.is_alive()
    stream.close()
