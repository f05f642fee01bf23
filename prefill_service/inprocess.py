"""InProcessPrefill: the prefill engine on its own thread, called like a remote prefill peer.

The decode scheduler calls it with a HandoffRequest after reserving the request's slots; it batches
whatever is queued, prefills, and delivers each Handoff (or a failure) through the callbacks. The
gRPC client replaces it between processes; tests and benchmarks use it in one process. It stands in
for another process beside a decode stream that computes here, so its thread has one intra-op thread
(a second OpenMP pool would slow every parallel region of the decode forward:
common/engine/intra_op.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from common.engine import intra_op
from common.engine.handoff import Handoff, HandoffRequest
from prefill_service.batching import take_batch
from prefill_service.engine import PrefillEngine


class InProcessPrefill:
    def __init__(
        self,
        engine: PrefillEngine,
        deliver: Callable[[Handoff], None],
        fail: Callable[[str, str], None],
        max_batch: int = 16,
    ):
        self.engine = engine
        self.deliver, self.fail = deliver, fail
        self.max_batch = max_batch
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=intra_op.thread_target(self._loop, threads=1), name="prefill", daemon=True
        )
        self._thread.start()

    def __call__(self, request: HandoffRequest) -> None:
        self._queue.put(request)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while (batch := take_batch(self._queue, self.max_batch)) is not None:
            try:
                handoffs = self.engine.prefill(batch)
            except Exception as e:  # every request of the batch fails; the decode side frees them
                for r in batch:
                    self.fail(r.rid, f"prefill failed: {e}")
                continue
            for h in handoffs:
                self.deliver(h)
