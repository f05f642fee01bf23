"""The decode service: the client-facing front door, gRPC `sglang.grpc.scheduler.SglangScheduler`.

The server is grpc.aio on its own event-loop thread: an open stream is a coroutine, not a thread, so
any number of open Generate calls leaves HealthCheck, grpc.health.v1, GetLoads and Abort answering
at once. The scheduler thread hands results to a call's queue with `call_soon_threadsafe`.

Lifecycle of one Generate call:
  1. admit (before anything is reserved): UNAVAILABLE when draining, the scheduler is down or no
     prefill replica is serving (cached health, re-checked live before refusing); INVALID_ARGUMENT
     for bad input (request_validation) or a request_id already in flight; RESOURCE_EXHAUSTED past
     `max_running_requests + max_queued_requests` open calls;
  2. submit to the DecodeScheduler under a unique internal id: it queues for admission, reserves
     the request slot + KV, and calls Prefill through the PrefillClient;
  3. stream: the first token as soon as prefill sends it, KV chunks written into the reserved slots
     as they arrive, then decode tokens; streaming calls get a chunk of new ids per step, then one
     Complete; non-streaming calls get one Complete with every id;
  4. an Abort RPC naming the request_id, or the call's cancellation, aborts the request (slot and KV
     freed exactly once, within a scheduler step); a broken handoff fails the call with UNAVAILABLE
     (INTERNAL if the scheduler broke).
Shutdown (`shutdown(grace_s)`, on SIGTERM/SIGINT): stop admitting, report NOT_SERVING, let open
calls finish for up to the grace period, abort the rest (their streams end with UNAVAILABLE), stop.
HealthCheck answers from cached state (scheduler alive, a prefill peer serving, not draining).
Liveness (grpc.health.v1, service `LIVENESS`, k8s' livenessProbe): SERVING while the scheduler (and
every TP rank) lives, whatever the prefill replicas do: a restart mends a dead scheduler, not a
missing prefill replica.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time

import grpc
from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common import tracing
from common.engine.model_runner import ModelRunner
from common.kv_transfer import receiver as kv_transport
from common.metrics import DecodeMetrics
from common.parallel.launch import TPRanks, check_settings
from common.request_rules import REFUSED
from common.wire import security
from common.wire.aio_server import AioServer, answer_unimplemented
from common.wire.servicer import add_servicer
from decode_service.config import DecodeConfig
from decode_service.inbox import Inbox
from decode_service.info_rpcs import InfoRpcs
from decode_service.prefill_client import PrefillClient
from decode_service.request_validation import InvalidRequest, parse_generate
from decode_service.scheduler import DecodeScheduler
from decode_service.tp_worker import TPDecodeWorker, follower_main
from decode_service.worker import DecodeWorker

logger = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"]
LIVENESS = "liveness"  # the grpc.health.v1 service name of decode's liveness (deploy/k8s/decode.yaml)


class _Reject(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


class DecodeService(InfoRpcs, pb_grpc.SglangSchedulerServicer):
    def __init__(self, config: DecodeConfig):
        kv_transport.check(config)  # before the model loads: say at once what to install, or what cannot work
        self.config = config
        check_settings(config)  # --tp-size > 1: the follower ranks (common/parallel/launch.py)
        self.tp_ranks = TPRanks.start(config, follower_main, "decode") if config.tp_size > 1 else None
        tp = self.tp_ranks.tp if self.tp_ranks else None
        self.runner = ModelRunner.for_service(config, tp)
        self.model_config = self.runner.config
        self.served_model_name = config.served_model_name or os.path.basename(os.path.abspath(config.model_path))
        kv = self.runner.kv_allocator
        self.metrics = DecodeMetrics(
            running=lambda: self.load_counts()[0],
            queued=lambda: self.load_counts()[1],
            kv_usage=lambda: kv.num_used / kv.size,
            open_streams=lambda: self._open,
            model_name=self.served_model_name,
        )
        self.metrics.watch_greedy_head(self.runner)
        inbox = Inbox()  # the prefill client delivers here; the scheduler drains it
        # the KV transport's decode side: with mooncake or shm our pools registered (or shared) and named
        # in each call, prefill writes KV into them; with grpc no destination (KV comes as bytes)
        self.kv_receiver = kv_transport.make_receiver(self.runner, config, tp)
        self.tracing = tracing.Tracing("decode", config.otlp_traces_endpoint)
        self.prefill = PrefillClient(
            config.prefill_addrs,
            self.model_config,
            inbox,
            wait_ready_s=config.prefill_wait_s,
            call_timeout_s=config.prefill_timeout_s,
            progress_timeout_s=config.prefill_progress_timeout_s,
            draft_config=self.runner.draft.config.layer if self.runner.draft else None,
            metrics=self.metrics,
            kv_destination=self.kv_receiver.destination,
            kv_keys=self.kv_receiver.keys,
            policy=config.prefill_policy,
            resolve_interval_s=config.prefill_resolve_interval_s,
            tracing=self.tracing,
            credentials=security.channel_credentials(
                config.prefill_tls_ca_file, config.tls_cert_file, config.tls_key_file
            ),
            api_key=config.internal_api_key,
        )
        worker = (
            TPDecodeWorker(self.runner, self.tp_ranks.tp, debug=config.debug_checks)
            if self.tp_ranks
            else DecodeWorker(self.runner, debug=config.debug_checks)
        )
        if self.tp_ranks:  # a rank gone: fail the stream, so calls end UNAVAILABLE and health says so
            self.tp_ranks.watch(worker.fail)
        self.scheduler = DecodeScheduler(
            worker,
            self.prefill,
            inbox,
            overlap=not config.disable_overlap_schedule,
            debug=config.debug_checks,
            metrics=self.metrics,
            abort_waits_for_prefill=self.kv_receiver.destination is not None,
        )
        self.metrics_port: int | None = None
        self._ids = itertools.count()
        self._live: dict[str, str] = {}  # client request_id -> internal id (only requests that name one)
        self._open_rids: set[str] = set()  # internal ids of every open Generate call (event loop only)
        self._draining = False
        self._prefill_serving = False
        self._recheck: asyncio.Future | None = None  # the replicas' health check in flight, if any
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch_health, name="health-watch", daemon=True)
        self.started_at = time.time()
        self.server = AioServer(
            config.host,
            config.port,
            [SERVICE.full_name],
            interceptors=security.interceptors(config.api_key),
            credentials=security.server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_ca_file),
        )
        add_servicer(self.server.server, self, SERVICE)  # malformed requests: INVALID_ARGUMENT

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> DecodeService:
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        self.scheduler.start()
        self._prefill_serving = self.prefill.any_serving()
        self._watcher.start()
        self.server.start()
        self.server.set_serving(self.healthy())
        self._set_live()
        return self

    def shutdown(self, grace_s: float) -> None:
        """Stop admitting, NOT_SERVING, wait up to `grace_s` for open calls, abort the rest, stop."""
        self._draining = True
        self.server.set_serving(False)
        deadline = time.monotonic() + grace_s
        while self._open_rids and time.monotonic() < deadline:
            time.sleep(0.05)
        open_rids = list(self.server.run(self._snapshot_open()))
        if open_rids:
            logger.info("aborting %d calls still open after the %.1fs grace period", len(open_rids), grace_s)
            for rid in open_rids:
                self._abort_internal(rid)
            deadline = time.monotonic() + 2.0  # their streams end with UNAVAILABLE before the server stops
            while self._open_rids and time.monotonic() < deadline:
                time.sleep(0.02)
        self.stop()

    async def _snapshot_open(self) -> list[str]:
        return list(self._open_rids)

    @property
    def _open(self) -> int:
        return len(self._open_rids)

    def stop(self) -> None:
        self._draining = True
        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join(timeout=5)
        self.server.stop(grace=1.0)
        self.scheduler.stop()
        if self.tp_ranks:
            self.tp_ranks.stop()
        self.prefill.close()
        self.metrics.close()
        self.tracing.shutdown()  # flushes spans still batched

    @property
    def address(self) -> str:
        return self.server.address

    def live(self) -> bool:
        """The scheduler and every TP rank run (False: only a restart mends it)."""
        return self.scheduler.alive and (self.tp_ranks is None or self.tp_ranks.alive())

    def healthy(self) -> bool:
        return self.live() and self._prefill_serving and not self._draining

    def _set_live(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self.live() else health_pb2.HealthCheckResponse.NOT_SERVING
        self.server.run(self.server.health.set(LIVENESS, status), timeout=5.0)

    def _watch_health(self) -> None:
        while not self._stop.wait(0.25):
            self._set_live()  # first: a prefill replica slow to answer must not delay it
            self._prefill_serving = self.prefill.any_serving()
            if not self._stop.is_set():
                self.server.set_serving(self.healthy())

    # ---- Generate --------------------------------------------------------------------------------
    async def Generate(self, request, context):
        if not self._prefill_serving:  # no await between _admit's checks and registering the call
            await self._recheck_prefill()
        try:
            ids, params = self._admit(request)
        except _Reject as e:
            await context.abort(e.code, e.detail)
        rid = f"{request.request_id or 'req'}#{next(self._ids)}"
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        self._open_rids.add(rid)
        if request.request_id:
            self._live[request.request_id] = rid
        finished = False
        span = self.tracing.start("generate", self.tracing.extract(context.invocation_metadata()), rid=rid)
        # rides on the request: the prefill client hangs its spans (and the replica's) under it
        trace = (self.tracing.context_of(span), time.time_ns()) if span is not None else None
        try:
            self.scheduler.submit(
                rid, ids, params, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out), trace=trace
            )
            async for response in self._responses(request, ids, outputs, context, trace):
                finished = response.HasField("complete")
                yield response
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (or the server stopped)
            # GeneratorExit: the cancel reached gRPC while it was sending a response this generator had
            # yielded, so it is closed at that yield instead of cancelled at an await
            self.metrics.aborts.inc()
            raise
        finally:
            if span is not None:
                span.set_attribute("finished", finished)
                span.end()
            self._open_rids.discard(rid)
            if request.request_id and self._live.get(request.request_id) == rid:
                del self._live[request.request_id]
            if not finished:  # cancelled, aborted or failed: free its slot and KV (a no-op if gone)
                self._abort_internal(rid)

    def _admit(self, request):
        """Checks before anything is reserved; (prompt ids, SamplingParams) or _Reject."""
        if self._draining:
            raise _Reject(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if not self.scheduler.alive:
            raise _Reject(grpc.StatusCode.UNAVAILABLE, "decode scheduler is not running")
        try:
            ids, params = parse_generate(
                request,
                self.model_config.vocab_size,
                self.runner.context_length,
                self.config.default_max_new_tokens,
                kv_room=self.scheduler.kv_room,
            )
        except InvalidRequest as e:
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        if request.request_id in self._live:
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request.request_id!r} is already in flight")
        if not self._prefill_serving:
            raise _Reject(grpc.StatusCode.UNAVAILABLE, "no prefill replica is serving")
        bound = self.config.max_running_requests + self.config.max_queued_requests
        if self._open >= bound:
            raise _Reject(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._open} requests open: the admission queue is full (max_queued_requests)",
            )
        return ids, params

    async def _recheck_prefill(self) -> None:
        """The cached health says no replica serves: every such call asks the replicas once before it
        fails (off the loop, over fresh channels, so a replica that just came up is used at once and a
        dead one refuses at once). Calls arriving while a check runs share it."""
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.get_running_loop().run_in_executor(None, self.prefill.any_serving, True)
        self._prefill_serving = await asyncio.shield(self._recheck)

    async def _responses(self, request, ids, outputs, context, trace):
        """The call's responses, from the scheduler's RequestOutputs (decode_service/output.py)."""
        all_ids: list[int] = []
        m, started = self.metrics, time.perf_counter()
        last = first_at = started
        while True:
            try:
                out = await asyncio.wait_for(outputs.get(), timeout=1.0)
            except asyncio.TimeoutError:  # never wait forever on a scheduler that died
                if not self.scheduler.alive:
                    await context.abort(
                        grpc.StatusCode.INTERNAL, f"decode scheduler failed: {self.scheduler.fatal_error!r}"
                    )
                continue
            tokens, finish = out.new_token_ids, out.finish
            reason = finish.reason if finish is not None else None
            if tokens:
                now = time.perf_counter()
                if not all_ids:
                    first_at = now
                    m.ttft.observe(now - started)
                    tokens_after_first = len(tokens) - 1
                else:
                    tokens_after_first = len(tokens)
                for _ in range(tokens_after_first):
                    m.itl.observe((now - last) / len(tokens))
                last = now
                m.generation_tokens.inc(len(tokens))
            all_ids.extend(tokens)
            if reason is not None:
                self.metrics.count_finish(reason, len(ids), started, first_at, len(all_ids))
                if all_ids and self.tracing.enabled:
                    parent = trace[0] if trace is not None else None
                    self.tracing.record(
                        "decode", parent, tracing.wall_ns(first_at), time.time_ns(), tokens=len(all_ids)
                    )
            if reason == "error":
                detail = finish.error or repr(self.scheduler.fatal_error)
                code = grpc.StatusCode.INTERNAL if not self.scheduler.alive else grpc.StatusCode.UNAVAILABLE
                if detail.startswith(REFUSED):  # not retryable: the client must change the request
                    code = grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, f"request failed: {detail}")
            if reason == "abort" and self._draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "server shut down before the request finished")
            if tokens and request.stream:
                yield pb.GenerateResponse(
                    request_id=request.request_id,
                    chunk=pb.GenerateStreamChunk(
                        token_ids=tokens, prompt_tokens=len(ids), completion_tokens=len(all_ids)
                    ),
                )
            if finish is not None:
                accepted, drafted = finish.spec_accepted, finish.spec_drafted
                if drafted:
                    m.spec_accepted.inc(accepted)
                    m.spec_drafted.inc(drafted)
                    m.spec_accept_length.observe(1 + accepted * self.config.speculative_num_steps / drafted)
                complete = pb.GenerateComplete(
                    output_ids=all_ids,
                    finish_reason=reason,
                    prompt_tokens=len(ids),
                    completion_tokens=len(all_ids),
                    cached_tokens=finish.cached_tokens,
                    spec_accepted_tokens=accepted,
                    spec_draft_tokens=drafted,
                )
                if finish.matched_stop is not None:
                    complete.matched_token_id = finish.matched_stop
                yield pb.GenerateResponse(request_id=request.request_id, complete=complete)
                return

    def _abort_internal(self, rid: str) -> None:
        self.scheduler.abort(rid)
        self.prefill.cancel(rid)

    # ---- control RPCs ----------------------------------------------------------------------------
    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Abort needs a request_id")
        rid = self._live.get(request.request_id)
        if rid is not None:
            self._abort_internal(rid)
        return pb.AbortResponse(
            success=rid is not None, message="aborted" if rid is not None else "unknown or finished request"
        )

    async def HealthCheck(self, request, context):
        healthy = self.healthy()
        if healthy:
            message = "ok"
        elif self._draining:
            message = "shutting down"
        else:
            message = "scheduler down" if not self.scheduler.alive else "no prefill replica serving"
        return pb.HealthCheckResponse(healthy=healthy, message=message)


answer_unimplemented(DecodeService, SERVICE)
