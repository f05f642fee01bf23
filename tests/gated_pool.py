"""A grammar compile pool that holds every compile until the test sets `gate` (tests hold compiles
in flight with it: `compiler.pool = GatedPool(compiler.pool)`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future


class GatedPool:
    def __init__(self, pool):
        self.pool, self.gate, self.started = pool, threading.Event(), threading.Event()

    def warm(self) -> None:
        self.pool.warm()

    def submit(self, *args) -> Future:
        fut: Future = Future()

        def run():
            self.started.set()
            self.gate.wait(30)
            job = self.pool.submit(*args)
            job.add_done_callback(
                lambda j: fut.set_exception(j.exception()) if j.exception() else fut.set_result(j.result())
            )

        threading.Thread(target=run, daemon=True).start()
        return fut
