"""The prefill service: gRPC `disagg.v1.Prefill` over a PrefillScheduler (the RPC layer).

The parts are built by wiring.py (runner, TP ranks, worker, scheduler, metrics, tracing, KV sender,
the gRPC server); a call's response stream is handoff_stream.py's. The server is grpc.aio on its own
event-loop thread (common/wire/aio_server.py): an open Prefill call is a coroutine, not a thread, so
any number of open calls leaves grpc.health.v1 and GetLoad answering at once. The scheduler thread
hands a call's first token and answer to its asyncio futures with `call_soon_threadsafe`.

Lifecycle of one Prefill call:
  0. admission: with --max-open-calls calls open, or as many queued in the scheduler (cancelled ones
     included until it drops them), RESOURCE_EXHAUSTED (decode tries another replica);
  1. validate the request (request_bounds.py: prompt ids, sampling params with <= 64 stop ids, fits
     the context, max_chunk_bytes 0 or in [256 KiB, 32 MiB], tp_ranks in a decode layout of this
     model): INVALID_ARGUMENT if not; FAILED_PRECONDITION if `kv_start_digest` does not match the ids
     before `kv_start` (decode then asks for the whole prompt's KV); UNAVAILABLE if the scheduler is not
     running;
  2. submit a PrefillCall to the scheduler (scheduler.py: `inbox` -> `waiting` -> `running`, one
     chunked extend forward per step, short prompts first); in the step its prompt completes, its
     first token is sampled and handed to the call at once, then its KV is copied out (with EAGLE
     after the draft extend) and its slots freed, and the call gets its Handoff (or an error);
  3. stream (handoff_stream.py): FirstToken as soon as it is sampled, then the KV part that the KV
     sender makes (KvChunks, or KvWritten notices after writes into decode's slots; with EAGLE the
     head's KV follows, marked `draft`), then the PrebuiltRecord; a failed prefill or transfer ends
     the call with INTERNAL;
  4. a cancelled call (the caller went away) is dropped while queued, its slots freed if it was
     mid-prefill, or it stops streaming; every call gets exactly one answer from the scheduler.
The service is stateless between calls. Health: NOT_SERVING until the model is loaded and the
scheduler runs, and again if the scheduler (or a TP rank) dies or the service stops. `stop(grace_s)`:
NOT_SERVING, calls not prefilled yet are answered (INTERNAL, decode retries them), calls still
streaming after `grace_s` are cancelled, then the transfer threads and the KV sender are let go.
Test hooks (hooks.py) are handed in: `PrefillService(config, hooks=...)`; none in production.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.engine.grammar import GrammarBusy
from common.request_rules import KvStartRefused
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from prefill_service import request_bounds, wiring
from prefill_service.config import PrefillConfig
from prefill_service.hooks import PrefillHooks
from prefill_service.scheduler import Answer, PrefillCall, QueueFull

logger = logging.getLogger(__name__)


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, config: PrefillConfig, hooks: PrefillHooks | None = None):
        self.config, self.hooks = config, hooks
        p = wiring.build(config, self._scheduler_failed, hooks)
        self.sender, self.tp_ranks, self.runner, self.tracing = p.sender, p.tp_ranks, p.runner, p.tracing
        self.worker, self.scheduler, self.metrics, self.streams = p.worker, p.scheduler, p.metrics, p.streams
        self.metrics_port: int | None = None
        self.open_calls = 0  # Prefill calls open (changed on the event loop only)
        self.server = wiring.serve(config, self)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> PrefillService:
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        self.scheduler.start()
        self.server.start()
        self.server.set_serving(True)
        if not self.scheduler.alive:  # it died before SERVING was set: its own report came first
            self.server.set_serving(False)
        if self.tp_ranks:  # a rank gone: refuse at once and report NOT_SERVING
            self.tp_ranks.watch(self._rank_died)
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """NOT_SERVING; calls not prefilled yet are answered; calls still streaming after `grace_s`
        are cancelled (decode retries them); then the transfer threads and the KV sender go."""
        self.server.set_serving(False)
        self.scheduler.stop()
        if self.tp_ranks:
            self.worker.stop_followers()
            self.tp_ranks.stop()
        self.server.stop(grace_s)
        self.metrics.close()
        self.tracing.shutdown()  # flushes spans still batched
        self.streams.close()
        self.sender.close()

    def _rank_died(self, reason: str) -> None:
        self.worker.mark_dead(reason)
        self._scheduler_failed(RuntimeError(reason))

    def _scheduler_failed(self, error: BaseException) -> None:
        logger.error("prefill scheduler died (%r): reporting NOT_SERVING", error)
        try:
            self.server.set_serving(False)
        except Exception:  # noqa: BLE001 - the server may be stopping too
            logger.exception("could not report NOT_SERVING")

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def num_queued(self) -> int:
        return self.scheduler.num_queued()

    @property
    def num_prefilled(self) -> int:
        return self.scheduler.num_prefilled

    @property
    def transfers_in_flight(self) -> int:
        return self.streams.transfers_in_flight

    @property
    def kv_notices(self) -> int:
        return self.streams.kv_notices

    # ---- RPCs ------------------------------------------------------------------------------------
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        if self.open_calls >= self.config.max_open_calls:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._busy(f"{self.open_calls} calls are open"))
        self.open_calls += 1  # from here: a call whose grammar compiles counts too
        try:
            async for message in self._prefill(request, context):
                yield message
        finally:
            self.open_calls -= 1

    async def _prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        if self.hooks is not None:
            self.hooks.received(request)
        try:
            args = (request, self.config.max_chunk_bytes, self.runner)
            if request.sampling_params.WhichOneof("constraint") is not None:  # a grammar compiles: off the loop
                handoff_request = await asyncio.to_thread(request_bounds.parse, *args)
            else:
                handoff_request = request_bounds.parse(*args)
        except GrammarBusy as e:  # too many grammars compiling here: another replica, or later
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._busy(str(e)))
        except KvStartRefused as e:  # decode asks again for the whole prompt's KV (not the client's error)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self.scheduler.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill scheduler is not running")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        first: asyncio.Future = loop.create_future()  # the first token, before the answer
        resolve_answer, m = _resolver(loop, answer), self.metrics

        def on_answer(result) -> None:  # the worker's thread: counted even if the caller has gone since
            if not isinstance(result, BaseException) and call.started_at:
                m.queue_time.observe(call.started_at - call.queued_at)
                m.compute.observe(call.finished_at - call.started_at)
                m.prompt_tokens.inc(result.prompt_len)
                m.cached_tokens.inc(result.cached_tokens)
            resolve_answer(result)

        call = PrefillCall(handoff_request, on_answer, _resolver(loop, first))
        context.add_done_callback(lambda _context: call.cancel())
        try:
            try:
                self.scheduler.submit(call)
            except QueueFull as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._busy(str(e)))
            except ValueError as e:  # the prompt or params against this replica's model and pool
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            async for message in self.streams.stream(request, call, answer, first, context):
                yield message
        finally:
            call.cancel()  # a no-op once answered; otherwise the scheduler drops it

    def _busy(self, why: str) -> str:
        return f"prefill replica busy: {why} (--max-open-calls {self.config.max_open_calls}); retry later or elsewhere"

    async def GetLoad(self, request, context):
        kv = self.runner.kv_allocator
        return prefill_pb2.LoadResponse(
            num_running_reqs=self.scheduler.num_running,
            num_waiting_reqs=self.scheduler.num_queued(),
            num_used_tokens=kv.num_used,
            max_total_tokens=kv.size,
        )


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    """A callback for any thread that resolves `future` on `loop` (unless it is done or cancelled)."""

    def resolve(result: Answer) -> None:
        if not future.done():
            future.set_result(result)

    def on_answer(result: Answer) -> None:
        try:
            loop.call_soon_threadsafe(resolve, result)
        except RuntimeError:  # the server's loop is closed: nobody waits for this answer any more
            pass

    return on_answer
