"""The decode service's composition root: every part of a decode replica built from its DecodeConfig.

`build` makes the parts in the order they depend on each other, and checks first what can be
checked before a model loads:
  1. the KV transport's requirements (common/kv_transfer/receiver.py: what to install, or what
     cannot work) and the TP settings; with --tp-size > 1 the follower ranks start
     (common/parallel/launch.py);
  2. the ModelRunner (rank 0's share of the model, its KV pools and allocator);
  3. the metrics (their gauges read the scheduler's queues, the KV allocator and the open calls);
  4. the scheduler's Inbox, the KV receiver (with mooncake or shm our pools registered or shared
     and named in each Prefill call, with grpc none) and the tracer;
  5. the PrefillClient over the prefill replicas, delivering into the inbox;
  6. the worker (DecodeWorker, or TPDecodeWorker that scatters each step to the ranks; a rank
     gone fails the worker) and the DecodeScheduler over it.
`serve` makes the gRPC server for a servicer, with the configured API keys and TLS. Nothing built
here serves yet: decode_service/server.py starts the scheduler, the health watcher and the server.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from common import tracing
from common.engine.model_runner import ModelRunner
from common.kv_transfer import receiver as kv_receivers
from common.metrics import DecodeMetrics
from common.parallel.launch import TPRanks, check_settings
from common.request_rules import max_request_bytes
from common.wire import security
from common.wire import servicer as servicer_module
from common.wire.aio_server import AioServer
from decode_service.config import DecodeConfig
from decode_service.hooks import DecodeHooks
from decode_service.inbox import Inbox
from decode_service.info_rpcs import load_counts
from decode_service.prefill_client import PrefillClient
from decode_service.scheduler import DecodeScheduler
from decode_service.tp_worker import TPDecodeWorker, follower_main
from decode_service.worker import DecodeWorker


@dataclass(frozen=True)
class DecodeParts:
    tp_ranks: TPRanks | None  # the follower ranks, with --tp-size > 1
    runner: ModelRunner
    served_model_name: str
    metrics: DecodeMetrics
    kv_receiver: kv_receivers.KvReceiver
    tracing: tracing.Tracing
    prefill: PrefillClient
    scheduler: DecodeScheduler


def build(config: DecodeConfig, open_streams: Callable[[], int], hooks: DecodeHooks | None = None) -> DecodeParts:
    """The parts of one decode replica; `open_streams` counts the front door's open Generate calls;
    `hooks`: a test's (decode_service/hooks.py), on every rank's worker."""
    kv_receivers.check(config)  # before the model loads: say at once what to install, or what cannot work
    check_settings(config)  # --tp-size > 1: the follower ranks (common/parallel/launch.py)
    follower = functools.partial(follower_main, hooks=hooks) if hooks is not None else follower_main
    tp_ranks = TPRanks.start(config, follower, "decode") if config.tp_size > 1 else None
    tp = tp_ranks.tp if tp_ranks else None
    runner = ModelRunner.for_service(config, tp)
    name = config.served_model_name or os.path.basename(os.path.abspath(config.model_path))
    kv = runner.kv_allocator
    metrics = DecodeMetrics(  # the gauges are read at scrape time, when `scheduler` below exists
        running=lambda: load_counts(scheduler)[0],
        queued=lambda: load_counts(scheduler)[1],
        kv_usage=lambda: scheduler.books.kv_in_use / kv.size,  # decode's cached prefixes nobody reads: free
        open_streams=open_streams,
        model_name=name,
    )
    metrics.watch_greedy_head(runner)
    metrics.watch_kv_committed(lambda: scheduler.running_batch.kv_committed_lens_sum)  # read at scrape time
    metrics.watch_expert_load(runner)
    inbox = Inbox()  # the prefill client delivers here; the scheduler drains it
    # the KV transport's decode side: with mooncake or shm our pools registered (or shared) and named
    # in each call, prefill writes KV into them; with grpc no destination (KV comes as bytes)
    kv_receiver = kv_receivers.make_receiver(runner, config, tp)
    tracer = tracing.Tracing("decode", config.otlp_traces_endpoint)
    prefill = PrefillClient(
        config.prefill_addrs,
        runner.config,
        inbox,
        wait_ready_s=config.prefill_wait_s,
        call_timeout_s=config.prefill_timeout_s,
        progress_timeout_s=config.prefill_progress_timeout_s,
        draft_config=runner.draft.config.layer if runner.draft else None,
        metrics=metrics,
        kv_receiver=kv_receiver,
        policy=config.prefill_policy,
        resolve_interval_s=config.prefill_resolve_interval_s,
        tracing=tracer,
        credentials=security.channel_credentials(config.prefill_tls_ca_file, config.tls_cert_file, config.tls_key_file),
        api_key=config.internal_api_key,
    )
    worker = (
        TPDecodeWorker(runner, tp_ranks.tp, debug=config.debug_checks, hooks=hooks)
        if tp_ranks
        else DecodeWorker(runner, debug=config.debug_checks, hooks=hooks)
    )
    if tp_ranks:  # a rank gone: fail the stream, so calls end UNAVAILABLE and health says so
        tp_ranks.watch(worker.fail)
    scheduler = DecodeScheduler(
        worker,
        prefill,
        inbox,
        overlap=not config.disable_overlap_schedule,
        debug=config.debug_checks,
        metrics=metrics,
        abort_waits_for_prefill=kv_receiver.writes_late,
        tokenizer_path=config.model_path,  # stop strings are matched in the checkpoint's tokenizer's text
        cancel_prefill=prefill.cancel,
        kv_reservation=config.decode_kv_reservation,
        kv_grow_tokens=config.decode_kv_grow_tokens,
        prefix_cache=config.disaggregation_decode_enable_radix_cache,
    )
    return DecodeParts(tp_ranks, runner, name, metrics, kv_receiver, tracer, prefill, scheduler)


def serve(config: DecodeConfig, servicer, service) -> AioServer:
    """The grpc.aio server for `servicer` (not started): API keys, TLS, malformed requests INVALID_ARGUMENT,
    messages past what a request within the model's context can take refused before they are parsed."""
    bound = max_request_bytes(servicer.runner.context_length)
    return servicer_module.serve(config, servicer, service, config.api_key, bound)
