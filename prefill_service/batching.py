"""take_batch: block for one queued item, then take whatever else is queued, up to a limit.

`None` on the queue is the stop sentinel: returned batches never contain it, and a sentinel met
while draining is put back so the next call returns None.
"""

from __future__ import annotations

import queue


def take_batch(q: queue.Queue, limit: int) -> list | None:
    first = q.get()
    if first is None:
        return None
    batch = [first]
    while len(batch) < limit:
        try:
            nxt = q.get_nowait()
        except queue.Empty:
            break
        if nxt is None:
            q.put(None)
            break
        batch.append(nxt)
    return batch
