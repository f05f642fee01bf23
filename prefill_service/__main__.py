"""python -m prefill_service --model-path DIR [--host 127.0.0.1 --port 30001 ...]

`main(argv, hooks)` is also the entry point of drills (bench/drill_prefill.py), with test hooks."""

from __future__ import annotations

import gc
import logging
import os

from common import omp_spin

omp_spin.set_default("prefill")  # before anything below imports torch (and so loads libgomp)

from common.parallel import launch
from common.wire.grpc_server import LoadInterrupted, ShutdownSignal
from prefill_service.config import parse_args
from prefill_service.hooks import PrefillHooks
from prefill_service.server import PrefillService
from prefill_service.tp_worker import follower_main


def main(argv=None, hooks: PrefillHooks | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    stop = ShutdownSignal()  # before anything loads: a signal while loading ends the start cleanly
    config = parse_args(argv)
    launch.exit_if_refused(config, "prefill")  # bad TP or node flags: said before anything loads
    try:
        if config.node_rank > 0:  # another node of a group across hosts: follower ranks only, no server
            raise SystemExit(launch.run_node(config, follower_main, "prefill"))
        logging.info("prefill service loading %s", config.model_path)
        service = PrefillService(config, hooks=hooks).start()
    except LoadInterrupted as e:
        logging.info("%s while loading: stopped", e)
        logging.shutdown()
        os._exit(0)  # threads the start made end with the process
    logging.info("prefill service serving %s on %s", config.model_path, service.address)
    gc.collect()
    gc.freeze()  # the start's objects out of the collector's way (docs/architecture.md)
    stop.wait()
    logging.info("prefill service stopping")
    service.stop(config.shutdown_grace_s)
    logging.info("stopped")
    logging.shutdown()
    os._exit(0)  # everything is released: skip interpreter teardown (~1.5 s of torch and gRPC finalizers)


if __name__ == "__main__":
    main()
