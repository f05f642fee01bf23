"""The decode service: the client-facing front door, gRPC `sglang.grpc.scheduler.SglangScheduler`.

Here: the RPC layer and the lifecycle. The parts come from wiring.py, step 1's checks from
admission.py, a call's messages from responses.py, readiness and liveness from health.py, the
read-only RPCs from info_rpcs.py. The server is grpc.aio on its own event-loop thread: an open
stream is a coroutine, not a thread, so any number of open Generate calls leaves HealthCheck,
grpc.health.v1, GetLoads and Abort answering at once. The scheduler thread hands results to a
call's queue with `call_soon_threadsafe`.

Lifecycle of one Generate call:
  1. admit (before anything is reserved): UNAVAILABLE when draining, the scheduler is down or no
     prefill replica is serving (cached health, re-checked live before refusing); INVALID_ARGUMENT
     for bad input (request_validation) or a request_id already in flight; RESOURCE_EXHAUSTED past
     `max_running_requests + max_queued_requests` open calls, or with too many grammars compiling;
  2. submit to the DecodeScheduler under a unique internal id: it queues for admission, reserves
     the request slot + KV, and calls Prefill through the PrefillClient;
  3. stream: the first token as soon as prefill sends it, KV chunks written into the reserved slots
     as they arrive, then decode tokens; streaming calls get a chunk of new ids per step, then one
     Complete; non-streaming calls get one Complete with every id (responses.py);
  4. an Abort RPC naming the request_id, or the call's cancellation, aborts the request (slot and KV
     freed exactly once, within a scheduler step); a broken handoff fails the call with UNAVAILABLE
     (INTERNAL if the scheduler broke).
Shutdown (`shutdown(grace_s)`, on SIGTERM/SIGINT): stop admitting, report NOT_SERVING, let open
calls finish for up to the grace period, abort the rest (their streams end with UNAVAILABLE), stop.
HealthCheck answers from cached state (scheduler alive, a prefill replica serving, not draining).
Liveness (grpc.health.v1, service `LIVENESS`, k8s' livenessProbe): SERVING while the scheduler (and
every TP rank) lives, whatever the prefill replicas do: a restart mends a dead scheduler, not a
missing prefill replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.request_rules import Overloaded
from common.wire.aio_server import answer_unimplemented
from decode_service import wiring
from decode_service.admission import Admission, Rejected
from decode_service.config import DecodeConfig
from decode_service.grammar_state import compile_off_loop
from decode_service.health import LIVENESS, Health
from decode_service.hooks import DecodeHooks
from decode_service.info_rpcs import InfoRpcs
from decode_service.request_validation import InvalidRequest
from decode_service.responses import Responder

__all__ = ["LIVENESS", "SERVICE", "DecodeService"]
logger = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"]


class DecodeService(InfoRpcs, pb_grpc.SglangSchedulerServicer):
    def __init__(self, config: DecodeConfig, hooks: DecodeHooks | None = None):
        self.config = config
        self._open_rids: set[str] = set()  # internal ids of every open Generate call (event loop only)
        p = wiring.build(config, open_streams=lambda: self._open, hooks=hooks)
        self.tp_ranks, self.runner, self.metrics, self.kv_receiver = p.tp_ranks, p.runner, p.metrics, p.kv_receiver
        self.tracing, self.prefill, self.scheduler = p.tracing, p.prefill, p.scheduler
        self.model_config, self.served_model_name = p.runner.config, p.served_model_name
        self.metrics_port: int | None = None
        self.openai = None  # the OpenAI HTTP API (decode_service/openai_api/), with --openai-port
        self._ids = itertools.count()
        self._live: dict[str, str] = {}  # client request_id -> internal id (only requests that name one)
        self.started_at = time.time()
        self.server = wiring.serve(config, self, SERVICE)
        self.health = Health(self.scheduler, self.tp_ranks, self.prefill, self.server)
        self._admission = Admission(config, self.runner, self.scheduler, self.health)
        self._responder = Responder(
            self.scheduler, self.metrics, self.tracing, config.speculative_num_steps, lambda: self.health.draining
        )

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> DecodeService:
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        self.scheduler.start()
        self.health.start()
        self.server.start()
        if self.config.openai_port is not None:  # on the gRPC server's loop: one front door, two protocols
            from decode_service.openai_api.http_server import OpenAIServer

            host = self.config.openai_host or self.config.host
            self.openai = OpenAIServer(self, host, self.config.openai_port, self.config.tool_call_parser).start()
        self.health.publish()
        return self

    def shutdown(self, grace_s: float) -> None:
        """Stop admitting, NOT_SERVING, wait up to `grace_s` for open calls, abort the rest, stop."""
        self.health.draining = True
        self.server.set_serving(False)
        deadline = time.monotonic() + grace_s
        while self._open_rids and time.monotonic() < deadline:
            time.sleep(0.05)
        open_rids = list(self.server.run(self._snapshot_open()))
        if open_rids:
            logger.info("aborting %d calls still open after the %.1fs grace period", len(open_rids), grace_s)
            for rid in open_rids:
                self.scheduler.abort(rid)  # the one door: it cancels the prefill call it started
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
        self.health.draining = True
        if self.openai is not None:
            self.openai.stop()
        self.health.stop()
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
        return self.health.live()

    def healthy(self) -> bool:
        return self.health.healthy()

    # ---- Generate --------------------------------------------------------------------------------
    async def Generate(self, request, context):
        async with contextlib.aclosing(self.generate(request, context.invocation_metadata())) as answer:
            try:
                async for response in answer:
                    yield response
            except Rejected as e:
                await context.abort(e.code, e.detail)

    async def generate(self, request, metadata=(), seed: int | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """One Generate request's answer, whichever door it came in by (gRPC's Generate, the OpenAI
        HTTP API): the lifecycle above, steps 1-4, on this loop; a refusal or failure raises Rejected
        (its gRPC status and detail). `metadata`: the caller's (a trace context); `seed`: the request's
        sampling seed, which the gRPC message cannot carry (None: drawn per request)."""
        if not self.health.prefill_serving:  # no await between admission's checks and registering the call
            await self.health.recheck_prefill()
        checked = self._admission.check(request, self._live, self._open, seed)
        rid = f"{request.request_id or 'req'}#{next(self._ids)}"
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        self._open_rids.add(rid)
        if request.request_id:
            self._live[request.request_id] = rid
        finished = False
        span = self.tracing.start("generate", self.tracing.extract(metadata), rid=rid)
        # rides on the request: the prefill client hangs its spans (and the replica's) under it
        trace = (self.tracing.context_of(span), time.time_ns()) if span is not None else None
        try:
            await compile_off_loop(self.scheduler.worker, checked.params)  # off the loop: submit finds it cached
            self.scheduler.submit_checked(
                rid, checked, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out), trace=trace
            )
            async for response in self._responder.stream(request, checked.prompt_ids, outputs, trace):
                yield response
            finished = True  # every sample's Complete is out
        except InvalidRequest as e:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except Overloaded as e:  # e.g. too many grammars compiling: retry later
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (or the server stopped)
            # GeneratorExit: the cancel reached the caller while it was sending a response this generator
            # had yielded, so it is closed at that yield instead of cancelled at an await
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
                self.scheduler.abort(rid)  # the one door: it cancels the prefill call it started

    # ---- control RPCs ----------------------------------------------------------------------------
    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Abort needs a request_id")
        rid = self._live.get(request.request_id)
        if rid is not None:
            self.scheduler.abort(rid)  # the one door: it cancels the prefill call it started
        return pb.AbortResponse(
            success=rid is not None, message="aborted" if rid is not None else "unknown or finished request"
        )

    async def HealthCheck(self, request, context):
        healthy, message = self.health.report()
        return pb.HealthCheckResponse(healthy=healthy, message=message)


answer_unimplemented(DecodeService, SERVICE)
