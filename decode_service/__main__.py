"""python -m decode_service --model-path DIR --prefill-addr HOST:PORT[,...] [--port 30000 ...]"""

from __future__ import annotations

import gc
import logging
import os

from common import omp_spin

omp_spin.set_default("decode")  # before anything below imports torch (and so loads libgomp)

from common.kv_transfer import shm_files
from common.parallel import launch
from common.wire.grpc_server import LoadInterrupted, ShutdownSignal
from decode_service.config import parse_args
from decode_service.server import DecodeService
from decode_service.tp_worker import follower_main


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(levelname)s %(message)s")
    stop = ShutdownSignal()  # before anything loads: a signal while loading ends the start cleanly
    config = parse_args(argv)
    launch.exit_if_refused(config, "decode")  # bad TP or node flags: said before anything loads
    if not 0 <= config.cpu_nice <= 19:
        raise SystemExit(f"--cpu-nice takes 0 to 19, got {config.cpu_nice}")
    if config.cpu_nice:  # before the model's and the server's threads start: they inherit it
        logging.info("decode service at nice %d (--cpu-nice %d)", os.nice(config.cpu_nice), config.cpu_nice)
    try:
        if config.node_rank > 0:  # another node of a group across hosts: follower ranks only, no server
            raise SystemExit(launch.run_node(config, follower_main, "decode"))
        logging.info("decode service loading %s", config.model_path)
        service = DecodeService(config).start()
    except LoadInterrupted as e:
        logging.info("%s while loading: stopped", e)
        shm_files.release_all()
        logging.shutdown()
        os._exit(0)  # threads the start made (prefill channels, TP followers' pipes) end with the process
    logging.info(
        "decode service serving %s as %r on %s (prefill: %s)",
        config.model_path,
        service.served_model_name,
        service.address,
        ",".join(config.prefill_addrs),
    )
    if service.openai is not None:
        logging.info("OpenAI HTTP API on http://%s/v1 (chat/completions, completions, models)", service.openai.address)
    gc.collect()
    gc.freeze()  # the start's objects out of the collector's way (docs/architecture.md)
    stop.wait()
    logging.info("decode service stopping")
    service.shutdown(config.shutdown_grace_s)
    shm_files.release_all()  # the shm handoff's pool files: os._exit below runs no exit handlers
    logging.info("stopped")
    logging.shutdown()
    os._exit(0)  # everything is released: skip interpreter teardown (~1.5 s of torch and gRPC finalizers)


if __name__ == "__main__":
    main()
