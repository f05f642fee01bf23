"""Run one function on N CPU processes joined in a gloo TPGroup (tensor parallelism tests).

`run_ranks(fn, size, *args)` spawns `size` processes; rank r calls fn(tp, *args) with its TPGroup and
returns a picklable result; the results come back in rank order (pickled to bytes by the rank, so
they need nothing from a rank process once it has exited). A rank that raises fails the call
with its traceback; a rank that hangs fails it after `timeout_s`."""

from __future__ import annotations

import pickle
import socket
import traceback

import torch.multiprocessing as mp

from common.parallel.tp_auth import new_key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, key: str, fn, args, queue) -> None:
    import torch

    from common.parallel.tp_group import TPGroup

    torch.set_num_threads(1)
    try:
        tp = TPGroup.init(rank, size, f"tcp://127.0.0.1:{port}", timeout_s=60, key=key)
        # pickled to bytes here: through the queue itself, a tensor travels as a shared-memory file
        # descriptor that the parent fetches from this process, which may have exited by then
        result = pickle.dumps(fn(tp, *args))
        queue.put((rank, "ok", result))
        tp.close()
    except BaseException:  # noqa: BLE001 (reported to the parent)
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, size: int, *args, timeout_s: float = 180.0) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, key = free_port(), new_key()
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, port, key, fn, args, queue), daemon=True) for r in range(size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(size):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "error":
                raise AssertionError(f"TP rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(size)]
