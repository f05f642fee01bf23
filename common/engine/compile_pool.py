"""Grammar compiles in worker processes, each ended at its deadline.

xgrammar cannot cancel a compile, and a constraint inside every structural bound can still compile
for seconds (grammar_limits.py). On a thread, a compile past its deadline would keep its CPU until it
ended; here it runs in a child process (grammar_worker.py), and a compile still running at its
deadline is ended by killing that process (a fresh one takes its place on the next compile).

`CompilePool.submit(...)` -> a Future of the compiled grammar's JSON (xgrammar's serialize_json; the
caller deserializes it with its TokenizerInfo). Rules:
- at most `max_workers` compiles run at once, one per process; a compile waits for a busy pool to
  free a process, in arrival order, for at most `timeout_s` (`NoWorkerFree` past it: retry later);
- a compile gets `timeout_s` of its worker's time, counted once the worker has it; one not answered
  by then kills its process (`CompileTimedOut`); a timeout of None waits as long as the compile
  takes (a TP follower's compile of what rank 0 compiled in time);
- `keep_idle` processes are kept ready: started ahead (`warm()`, at a compiler's creation, and again
  after a worker ends), since starting one takes ~1-4 s (it imports xgrammar, which imports torch);
  the others exit when their compile ends;
- a process learns each tokenizer once (sent with its first compile for it).
A worker reads end of input when this process ends, and exits (one mid-compile exits when that compile
ends: its answer has nowhere to go).
The pool is one per process (`shared_pool()`): compilers of several models share its processes.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

# compiles at once in a process's pool: each worker holds ~0.25-0.3 GB (xgrammar imports torch) and a
# compile is single-threaded, so more workers than cores only slows every compile (2 at least)
MAX_WORKERS = min(4, max(2, os.cpu_count() or 2))
KEEP_IDLE = 1
START_TIMEOUT_S = 120.0  # a worker that has not said "ready" by then is killed (a broken install)
WORKER = [sys.executable, "-m", "common.engine.grammar_worker"]
logger = logging.getLogger(__name__)
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding `common`, for the child's imports


class CompileTimedOut(Exception):
    """The compile was still running at its deadline: its process was killed."""


class NoWorkerFree(Exception):
    """Every worker was busy until the compile's deadline."""


class CompileFailed(Exception):
    """The constraint does not compile (the worker's first line of why), or the worker died."""


class _Worker:
    """One child process and our end of its socket pair."""

    def __init__(self, command: list[str]):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        try:
            self.proc = subprocess.Popen(
                [*command, str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.tokenizers: set[int] = set()
        if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv() != ("ready",):
            self.kill()
            raise OSError(f"the compile worker did not start within {START_TIMEOUT_S:g} s")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def close(self) -> None:
        """End of input: the worker leaves its loop and exits."""
        self.conn.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


class CompilePool:
    """Worker processes for grammar compiles (see the module)."""

    def __init__(self, max_workers: int = MAX_WORKERS, keep_idle: int = KEEP_IDLE, command: list[str] = WORKER):
        self.max_workers, self.keep_idle, self.command = max_workers, keep_idle, list(command)
        self._cv = threading.Condition()
        self._idle: list[_Worker] = []
        self._starting = 0  # spares being started by warm()
        self._line: list[object] = []  # compiles waiting for a worker, first come first served
        self.alive = 0  # workers started and not yet ended (idle, busy or starting)
        self.killed = 0  # workers killed at a deadline or after dying mid-compile

    def submit(self, key: int, tokenizer, any_whitespace: bool, field: str, text: str, timeout_s: float | None):
        """A Future of the compiled grammar's JSON; `tokenizer()` gives the TokenizerInfo's JSON (called
        on the pool's thread, the first time a worker needs it)."""
        fut: Future = Future()
        args = (fut, key, tokenizer, any_whitespace, field, text, timeout_s)
        threading.Thread(target=self._run, args=args, name="grammar-compile", daemon=True).start()
        return fut

    def _run(self, fut: Future, key, tokenizer, any_ws, field, text, timeout_s) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            info_json = tokenizer()
            worker = self._take(None if timeout_s is None else time.monotonic() + timeout_s)
        except Exception as e:  # noqa: BLE001 (the tokenizer did not load, or no worker could start)
            fut.set_exception(CompileFailed(f"no compile could start ({e})"))
            return
        if worker is None:
            fut.set_exception(NoWorkerFree(f"{self.max_workers} compiles were running all that time"))
            return
        try:
            if key not in worker.tokenizers:
                worker.conn.send(("tokenizer", key, info_json, any_ws))
                worker.tokenizers.add(key)
            worker.conn.send(("compile", key, field, text))
            if not worker.conn.poll(timeout_s):
                self._end(worker, kill=True)
                fut.set_exception(CompileTimedOut())
                return
            status, payload = worker.conn.recv()
        except (EOFError, OSError) as e:
            self._end(worker, kill=True)
            fut.set_exception(CompileFailed(f"the compile worker ended mid-compile ({e!r})"))
            return
        self._give_back(worker)
        if status == "ok":
            fut.set_result(payload)
        else:
            fut.set_exception(CompileFailed(payload))

    def warm(self) -> None:
        """Start workers in the background until `keep_idle` are ready or starting (within max_workers)."""
        with self._cv:
            if len(self._idle) + self._starting >= self.keep_idle or self.alive >= self.max_workers:
                return
            self.alive += 1
            self._starting += 1
        threading.Thread(target=self._start_spare, name="grammar-worker-start", daemon=True).start()

    def _start_spare(self) -> None:
        try:
            worker = _Worker(self.command)
        except Exception as e:  # noqa: BLE001 (a compile that needs one starts its own and says why)
            logger.warning("a grammar compile worker did not start: %s", e)
            worker = None
        with self._cv:
            self._starting -= 1
            if worker is None:
                self.alive -= 1
            else:
                self._idle.append(worker)
            self._cv.notify_all()

    def _take(self, deadline: float | None) -> _Worker | None:
        """An idle worker, a new one while fewer than max_workers live and none is starting, or None
        when every worker stayed busy until the deadline. Compiles get workers in the order they came."""
        ticket = object()
        with self._cv:
            self._line.append(ticket)
            try:
                while True:
                    if self._line[0] is ticket and self._idle:
                        return self._idle.pop()
                    if self._line[0] is ticket and self.alive < self.max_workers and not self._starting:
                        self.alive += 1
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0 and not self._starting:
                        return None
                    self._cv.wait(None if left is None or self._starting else left)
            finally:
                self._line.remove(ticket)
                self._cv.notify_all()
        try:
            return _Worker(self.command)
        except BaseException:
            with self._cv:
                self.alive -= 1
                self._cv.notify_all()
            raise

    def _give_back(self, worker: _Worker) -> None:
        with self._cv:
            if len(self._idle) < self.keep_idle:
                self._idle.append(worker)
                self._cv.notify_all()
                return
        self._end(worker, kill=False)

    def _end(self, worker: _Worker, kill: bool) -> None:
        worker.kill() if kill else worker.close()
        with self._cv:
            self.alive -= 1
            self.killed += kill
            self._cv.notify_all()
        self.warm()

    def close(self) -> None:
        """Ends the idle workers (busy ones end with their compile, or with this process)."""
        with self._cv:
            idle, self._idle = self._idle, []
        for worker in idle:
            self._end(worker, kill=False)


_pool: CompilePool | None = None
_pool_lock = threading.Lock()


def shared_pool() -> CompilePool:
    """This process's pool, made on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = CompilePool()
        return _pool
