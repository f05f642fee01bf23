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
One process per device. A group across hosts (`--nnodes M`, common/parallel/nodes.py): node 0 runs
the service as above with its share of the ranks, its store on `--dist-init-addr`, and the key from
`--tp-key-file`; `run_node` is a node other than 0: its ranks (this process the first, the others
children) follow rank 0 until it stops them, then the process exits (rank 0 gone: exit 1).
"""

from __future__ import annotations

import logging
import sys
import threading

import torch.multiprocessing as mp

from common.parallel import nodes, tp_auth
from common.parallel.tp_group import TPGroup

log = logging.getLogger(__name__)


def check_settings(config) -> None:
    """A bad --tp-size, and what --tp-size > 1 does not do yet, refused before anything loads."""
    if config.tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {config.tp_size}")
    if config.ep_size not in (1, config.tp_size):
        raise ValueError(f"--ep-size must be 1 or --tp-size ({config.tp_size}), got {config.ep_size}")
    nodes.check(config)


def exit_if_refused(config, name: str) -> None:
    """check_settings at a service's start: a refusal ends the process (exit 2) with its reason."""
    try:
        check_settings(config)
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _rank_main(follower, config, rank: int, init: str, name: str, key: str, bind: str, local_rank: int) -> None:
    """A follower rank's process: join the group, then `follower(config, tp)` until rank 0 stops it."""
    from common import omp_spin

    omp_spin.set_default(name)  # a no-op in effect: the rank inherits the service's environment (set
    # before torch loaded there), and unpickling this target has loaded torch here already
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name}-tp{rank} %(levelname)s %(message)s")
    tp = TPGroup.init(rank, config.tp_size, init, config.device, key=key, bind_host=bind, local_rank=local_rank)
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
        if nodes.settings(config)[1] != 0:
            raise ValueError("--node-rank > 0 runs no service: its process runs launch.run_node (python -m ...)")
        host, port = nodes.store_address(config)
        listener = tp_auth.listen(host, port)
        port, key = listener.getsockname()[1], nodes.group_key(config)
        init = f"tcp://{host}:{port}"
        procs = _spawn(follower, config, nodes.ranks_of_node(config)[1:], init, name, key, host)
        try:
            for p in procs:
                p.start()
            tp = TPGroup.init(0, config.tp_size, init, config.device, key=key, listener=listener)
        except BaseException:
            listener.close()  # a no-op if the group took it
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise
        log.info("tensor parallel: %d ranks, %d here, store on %s:%d", config.tp_size, len(procs) + 1, host, port)
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


def _spawn(follower, config, ranks, init: str, name: str, key: str, bind: str) -> list:
    """The (not yet started) processes of this node's follower ranks, local device index from 1 on."""
    ctx = mp.get_context("spawn")
    return [
        ctx.Process(
            target=_rank_main,
            args=(follower, config, r, init, name, key, bind, i),
            name=f"{name}-tp{r}",
            daemon=True,
        )
        for i, r in enumerate(ranks, start=1)
    ]


def run_node(config, follower, name: str) -> int:
    """Node `--node-rank` > 0 of a group across hosts: its ranks follow rank 0 until the group ends.
    Returns the exit code: 0 when rank 0 stopped the group, 1 when it (or a rank here) failed."""
    check_settings(config)
    host, port = nodes.store_address(config)
    key, bind = nodes.group_key(config), nodes.local_address(host, port)
    init, ranks = f"tcp://{host}:{port}", nodes.ranks_of_node(config)
    log.info(
        "node %d: TP ranks %d..%d of %d, rank 0 at %s:%d",
        config.node_rank,
        ranks[0],
        ranks[-1],
        config.tp_size,
        host,
        port,
    )
    procs = _spawn(follower, config, ranks[1:], init, name, key, bind)
    code = 0
    try:
        for p in procs:
            p.start()
        _rank_main(follower, config, ranks[0], init, name, key, bind, 0)
    except SystemExit as e:
        code = e.code or 1
    except BaseException:  # a signal (common/wire/grpc_server.py LoadInterrupted): the ranks here go too
        code = 1
        raise
    finally:
        for p in procs:
            p.join(timeout=30 if code == 0 else 5)
            if p.is_alive():
                p.kill()
                p.join()
    return code if code else int(any(p.exitcode for p in procs))
