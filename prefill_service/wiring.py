"""The prefill service's composition root: every part of a prefill replica built from its PrefillConfig.

`build` makes the parts in the order they depend on each other, and checks first what can be
checked before a model loads:
  1. the KV sender (common/kv_transfer/sender.py: a backend that cannot work here says so at once),
     the TP settings and the call bounds (--max-chunk-bytes, --max-open-calls); with --tp-size > 1
     the follower ranks start (common/parallel/launch.py);
  2. the ModelRunner (rank 0's share of the model, its KV pool and allocator) and the tracer;
  3. the worker (PrefillWorker, or TPPrefillWorker that broadcasts each call to the ranks), copying
     finished prompts' KV out to where the sender wants it, and the PrefillScheduler over it;
  4. the metrics (their gauges read the scheduler, the KV allocator, the prefix cache and the
     transfers in flight) and the HandoffStreams that send each call's answer.
`serve` makes the gRPC server for the servicer, with the internal API keys and TLS. Test hooks
(hooks.py) are handed in, never read from the config. Nothing here starts a thread (the TP ranks
aside) or answers a call: prefill_service/server.py does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from common import tracing
from common.engine.model_runner import ModelRunner
from common.kv_transfer.sender import KvSender, make_sender
from common.metrics import PrefillMetrics
from common.parallel.launch import TPRanks, check_settings
from common.wire import servicer as servicer_module
from common.wire.aio_server import AioServer
from common.wire.grpc_server import MAX_CHUNK_BYTES
from common.wire.proto_gen import prefill_pb2
from prefill_service.config import PrefillConfig
from prefill_service.handoff_stream import HandoffStreams
from prefill_service.hooks import PrefillHooks
from prefill_service.scheduler import PrefillScheduler
from prefill_service.tp_worker import TPPrefillWorker, follower_main
from prefill_service.worker import PrefillWorker

SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]


@dataclass(frozen=True)
class PrefillParts:
    sender: KvSender
    tp_ranks: TPRanks | None  # the follower ranks, with --tp-size > 1
    runner: ModelRunner
    tracing: tracing.Tracing
    worker: PrefillWorker
    scheduler: PrefillScheduler
    metrics: PrefillMetrics
    streams: HandoffStreams


def build(
    config: PrefillConfig, on_fatal: Callable[[BaseException], None], hooks: PrefillHooks | None = None
) -> PrefillParts:
    """The parts of one prefill replica; `on_fatal(error)` when the scheduler dies."""
    sender = make_sender(config)  # the KV transport's prefill side, before the model loads
    check_settings(config)
    if not 0 < config.max_chunk_bytes <= MAX_CHUNK_BYTES:  # a chunk's message stays under the receive limit
        raise ValueError(f"--max-chunk-bytes must be within [1, {MAX_CHUNK_BYTES}], got {config.max_chunk_bytes}")
    if config.max_open_calls < 1:
        raise ValueError(f"--max-open-calls must be >= 1, got {config.max_open_calls}")
    tp_ranks = TPRanks.start(config, follower_main, "prefill") if config.tp_size > 1 else None
    tp = tp_ranks.tp if tp_ranks else None
    runner = ModelRunner.for_service(config, tp)
    tracer = tracing.Tracing("prefill", config.otlp_traces_endpoint)
    cache = not config.disable_radix_cache
    staging = sender.staging_device(runner.device)  # where handoffs' KV is copied out to
    worker = (
        TPPrefillWorker(runner, tp, config.chunked_prefill_size, cache, staging)
        if tp
        else PrefillWorker(runner, config.chunked_prefill_size, cache, staging)
    )
    scheduler = PrefillScheduler(
        worker,
        config.max_running_requests,
        debug_checks=config.debug_checks,
        on_fatal=on_fatal,
        max_pending=config.max_open_calls,
        hooks=hooks,
    )
    kv = runner.kv_allocator
    metrics = PrefillMetrics(  # the gauges are read at scrape time, when `streams` below exists
        running=lambda: scheduler.num_running,
        queued=scheduler.num_queued,
        kv_usage=lambda: kv.num_used / kv.size,
        transfers_in_flight=lambda: streams.transfers_in_flight,
        cache_hit_rate=lambda: worker.stats.hit_rate,
        cache_tokens=lambda: worker.cache.tree_size if worker.cache else 0,
        model_name=os.path.basename(os.path.abspath(config.model_path)),  # as decode's default name
    )
    metrics.watch_greedy_head(runner)
    metrics.watch_expert_load(runner)
    streams = HandoffStreams(sender, metrics, tracer, config.max_chunk_bytes, hooks)
    return PrefillParts(sender, tp_ranks, runner, tracer, worker, scheduler, metrics, streams)


def serve(config: PrefillConfig, servicer) -> AioServer:
    """The grpc.aio server for `servicer` (not started), with the internal key's tokens and TLS."""
    return servicer_module.serve(config, servicer, SERVICE, config.internal_api_key, signed=True)
