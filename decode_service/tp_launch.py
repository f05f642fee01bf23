"""Start the decode service's tensor-parallel ranks (--tp-size N): rank 0 is this process, ranks
1..N-1 are child processes that load their shard and follow rank 0's stream (tp_worker.py).

1. `TPRanks.start(config)` picks the group's port on loopback (`--tp-port`, 0 = any free one),
   spawns the followers, joins the group as rank 0 and returns;
2. `watch(on_death)` calls `on_death(message)` once when a follower exits: the service then fails its
   stream, so health turns NOT_SERVING and open calls end UNAVAILABLE instead of hanging;
3. `stop()` ends the followers (after the worker sent "stop"; killed if they do not exit).
All ranks run on this host (one process per device); several hosts per rank group are not built.
"""

from __future__ import annotations

import logging
import threading

import torch.multiprocessing as mp

from common.parallel.tp_group import TPGroup

log = logging.getLogger(__name__)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def follower_main(config, rank: int, port: int) -> None:
    """A follower rank's process: its shard, a worker, and rank 0's messages until stop."""
    from common import omp_spin

    omp_spin.set_default()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s decode-tp{rank} %(levelname)s %(message)s")
    from common.engine.model_runner import ModelRunner
    from decode_service.tp_worker import follow
    from decode_service.worker import DecodeWorker

    tp = TPGroup.init(rank, config.tp_size, f"tcp://127.0.0.1:{port}", config.device)
    worker = DecodeWorker(ModelRunner.for_service(config, tp), debug=config.debug_checks)
    try:
        follow(worker, tp)
        log.info("TP rank %d stopped", rank)
    except Exception as e:  # noqa: BLE001 (rank 0 gone: the collective failed)
        log.error("TP rank %d ends: %s", rank, e)
        raise SystemExit(1) from e


class TPRanks:
    def __init__(self, tp: TPGroup, procs: list):
        self.tp, self.procs = tp, procs
        self._stop = threading.Event()

    @classmethod
    def start(cls, config) -> TPRanks:
        port = config.tp_port or _free_port()
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=follower_main, args=(config, r, port), name=f"decode-tp{r}", daemon=True)
            for r in range(1, config.tp_size)
        ]
        for p in procs:
            p.start()
        tp = TPGroup.init(0, config.tp_size, f"tcp://127.0.0.1:{port}", config.device)
        log.info("tensor parallel: %d ranks on port %d", config.tp_size, port)
        return cls(tp, procs)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def watch(self, on_death) -> None:
        def loop():
            while not self._stop.wait(0.2):
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    on_death(f"TP rank {dead[0].name} exited (code {dead[0].exitcode})")
                    return

        threading.Thread(target=loop, name="tp-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self.tp.close()
