"""Start a service's tensor-parallel ranks (--tp-size N): rank 0 is this process, ranks 1..N-1 are
child processes that load their shard and follow rank 0 (decode_service/tp_worker.py,
prefill_service/tp_worker.py).

1. `TPRanks.start(config, follower, name)` listens on loopback (`--tp-port`, 0 = any free one; the
   port is held from then on, no bind-and-release race), makes the launch's key (tp_auth.py: handed to
   the followers through multiprocessing's pipe, never a command line or the environment), spawns the
   followers (each runs `follower(config, tp)` after joining the group: a top-level function, so the
   spawned process can import it), joins as rank 0 and returns;
2. `watch(on_death)` calls `on_death(message)` once when a follower exits: the service then fails
   its work, so health turns NOT_SERVING and calls fail instead of hanging;
3. `stop()` ends the followers (after rank 0 sent "stop"; killed if they do not exit).
All ranks run on this host (one process per device); several hosts per rank group are not built.
"""

from __future__ import annotations

import logging
import threading

import torch.multiprocessing as mp

from common.parallel import tp_auth
from common.parallel.tp_group import TPGroup

log = logging.getLogger(__name__)


def check_settings(config) -> None:
    """A bad --tp-size, and what --tp-size > 1 does not do yet, refused before anything loads."""
    if config.tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {config.tp_size}")
    if config.ep_size not in (1, config.tp_size):
        raise ValueError(f"--ep-size must be 1 or --tp-size ({config.tp_size}), got {config.ep_size}")
    if config.tp_size == 1:
        return


def _rank_main(follower, config, rank: int, port: int, name: str, key: str) -> None:
    """A follower rank's process: join the group, then `follower(config, tp)` until rank 0 stops it."""
    from common import omp_spin

    omp_spin.set_default(name)  # a no-op in effect: the rank inherits the service's environment (set
    # before torch loaded there), and unpickling this target has loaded torch here already
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name}-tp{rank} %(levelname)s %(message)s")
    tp = TPGroup.init(rank, config.tp_size, f"tcp://127.0.0.1:{port}", config.device, key=key)
    try:
        follower(config, tp)
        log.info("TP rank %d stopped", rank)
    except Exception as e:  # noqa: BLE001 (rank 0 gone: the collective failed)
        log.error("TP rank %d ends: %s", rank, e)
        raise SystemExit(1) from e


class TPRanks:
    def __init__(self, tp: TPGroup, procs: list):
        self.tp, self.procs = tp, procs
        self._stop = threading.Event()

    @classmethod
    def start(cls, config, follower, name: str) -> TPRanks:
        listener = tp_auth.listen("127.0.0.1", config.tp_port)
        port, key = listener.getsockname()[1], tp_auth.new_key()
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=_rank_main, args=(follower, config, r, port, name, key), name=f"{name}-tp{r}", daemon=True
            )
            for r in range(1, config.tp_size)
        ]
        try:
            for p in procs:
                p.start()
            tp = TPGroup.init(0, config.tp_size, f"tcp://127.0.0.1:{port}", config.device, key=key, listener=listener)
        except BaseException:
            listener.close()  # a no-op if the group took it
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise
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
