"""The prefill service: gRPC `disagg.v1.Prefill` over a PrefillScheduler.

The server is grpc.aio on its own event-loop thread (common/wire/aio_server.py): an open Prefill call
is a coroutine, not a thread, so any number of open calls leaves grpc.health.v1 and GetLoad
answering at once. The scheduler thread hands a call's answer to its asyncio future with
`call_soon_threadsafe`; KV chunks are built on a small pool of single-intra-op threads, so neither
the loop nor a chunk's copies start another OpenMP pool (common/engine/intra_op.py).

Lifecycle of one Prefill call:
  0. admission: with --max-open-calls calls open, or as many queued in the scheduler (cancelled ones
     included until it drops them), RESOURCE_EXHAUSTED (decode tries another replica);
  1. validate the request (prompt ids, sampling params with <= 64 stop ids, fits the context, max_chunk_bytes
     0 or in [256 KiB, 32 MiB], tp_ranks in a decode layout of this model): INVALID_ARGUMENT if not;
     UNAVAILABLE if the scheduler is not running;
  2. submit a PrefillCall to the scheduler (scheduler.py: `inbox` -> `waiting` -> `running`, one
     chunked extend forward per step, short prompts first); in the step its prompt completes, its
     first token is sampled and handed to the call at once, then its KV is copied out (with EAGLE
     after the draft extend) and its slots freed, and the call gets its Handoff (or an error:
     INTERNAL);
  3. stream: FirstToken as soon as it is sampled (before the copy-out), then the KV part that the
     KV sender makes (common/kv_transfer/sender.py): KvChunks, or KvWritten notices after each
     chunk's writes into decode's slots, bounded by max_chunk_bytes (with EAGLE the head's KV
     follows, marked `draft`), then the PrebuiltRecord (prompt length, first token, chunk count,
     and with EAGLE the draft seed);
  4. a cancelled call (the caller went away) is dropped while queued, its slots freed if it was
     mid-prefill, or it stops streaming; every call gets exactly one answer from the scheduler.
The service is stateless between calls. Health: NOT_SERVING until the model is loaded and the
scheduler runs, and again if the scheduler dies or the service stops. `stop(grace_s)`: NOT_SERVING,
calls not prefilled yet are answered (INTERNAL, decode retries them), calls still streaming after
`grace_s` are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from common import tracing
from common.engine import intra_op
from common.engine.handoff import HandoffRequest
from common.engine.model_runner import ModelRunner
from common.engine.sampling import SamplingParams
from common.kv_transfer.errors import KvTransferError
from common.kv_transfer.sender import make_sender
from common.metrics import PrefillMetrics
from common.parallel.launch import TPRanks, check_settings
from common.request_rules import stop_token_ids, validate_prompt
from common.wire import kv_chunks, security
from common.wire.aio_server import AioServer
from common.wire.grpc_server import MAX_CHUNK_BYTES
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from common.wire.servicer import add_servicer
from prefill_service import request_bounds
from prefill_service.config import PrefillConfig
from prefill_service.engine import PrefillEngine
from prefill_service.fault_injection import STALL_MAX_S, FaultInjector, FaultPlan
from prefill_service.outbox import Outbox
from prefill_service.scheduler import Answer, PrefillCall, PrefillScheduler, QueueFull
from prefill_service.tp_engine import TPPrefillEngine, follower_main

logger = logging.getLogger(__name__)
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, config: PrefillConfig):
        # the KV transport's prefill side, before the model loads: a backend that cannot work says so at once
        self.sender = make_sender(config)
        self.config = config
        check_settings(config)
        if not 0 < config.max_chunk_bytes <= MAX_CHUNK_BYTES:  # a chunk's message stays under the receive limit
            raise ValueError(f"--max-chunk-bytes must be within [1, {MAX_CHUNK_BYTES}], got {config.max_chunk_bytes}")
        if config.max_open_calls < 1:
            raise ValueError(f"--max-open-calls must be >= 1, got {config.max_open_calls}")
        self.tp_ranks = TPRanks.start(config, follower_main, "prefill") if config.tp_size > 1 else None
        tp = self.tp_ranks.tp if self.tp_ranks else None
        self.runner = ModelRunner.for_service(config, tp)
        self.tracing = tracing.Tracing("prefill", config.otlp_traces_endpoint)
        cache = not config.disable_radix_cache
        staging = self.sender.staging_device(self.runner.device)  # where handoffs' KV is copied out to
        self.engine = (
            TPPrefillEngine(self.runner, tp, config.chunked_prefill_size, cache, staging)
            if tp
            else PrefillEngine(self.runner, config.chunked_prefill_size, cache, staging)
        )
        self.scheduler = PrefillScheduler(
            self.engine,
            config.max_running_requests,
            debug_checks=config.debug_checks,
            test_step_delay_s=config.test_step_delay_s,
            on_fatal=self._scheduler_failed,
            max_pending=config.max_open_calls,
        )
        self.faults = FaultInjector(FaultPlan.parse(config.inject_faults))
        kv = self.runner.kv_allocator
        self.metrics = PrefillMetrics(
            running=lambda: self.scheduler.num_running,
            queued=self.scheduler.num_queued,
            kv_usage=lambda: kv.num_used / kv.size,
            transfers_in_flight=lambda: self.transfers_in_flight,
            cache_hit_rate=lambda: self.engine.stats.hit_rate,
            cache_tokens=lambda: self.engine.cache.tree_size if self.engine.cache else 0,
            model_name=os.path.basename(os.path.abspath(config.model_path)),  # as decode's default name
        )
        self.metrics.watch_greedy_head(self.runner)
        self.metrics_port: int | None = None
        self.open_calls = 0  # Prefill calls open (changed on the event loop only)
        self.transfers_in_flight = 0  # calls between their first token and their record (event loop only)
        self.kv_notices = 0  # KvWritten notices sent since start (KV written through the transfer engine)
        self._chunk_pool = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kv-chunks", initializer=intra_op.pin_single
        )
        self.server = AioServer(
            config.host,
            config.port,
            [SERVICE_NAME],
            interceptors=security.interceptors(config.internal_api_key),
            credentials=security.server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_ca_file),
        )
        add_servicer(self.server.server, self, prefill_pb2.DESCRIPTOR.services_by_name["Prefill"])

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

    def _rank_died(self, reason: str) -> None:
        self.engine.mark_dead(reason)
        self._scheduler_failed(RuntimeError(reason))

    def stop(self, grace_s: float = 2.0) -> None:
        """NOT_SERVING; calls not prefilled yet are answered; calls still streaming after `grace_s`
        are cancelled (decode retries them)."""
        self.server.set_serving(False)
        self.scheduler.stop()
        if self.tp_ranks:
            self.engine.stop_followers()
            self.tp_ranks.stop()
        self.server.stop(grace_s)
        self.metrics.close()
        self.tracing.shutdown()  # flushes spans still batched
        self._chunk_pool.shutdown(wait=False, cancel_futures=True)

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

    # ---- RPCs ------------------------------------------------------------------------------------
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        if self.open_calls >= self.config.max_open_calls:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._busy(f"{self.open_calls} calls are open"))
        try:
            handoff_request = self._parse(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self.scheduler.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill scheduler is not running")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        first: asyncio.Future = loop.create_future()  # the first token, before the answer
        resolve_answer, m = _resolver(loop, answer), self.metrics

        def on_answer(result) -> None:  # the engine's thread: counted even if the caller has gone since
            if not isinstance(result, BaseException) and call.started_at:
                m.queue_time.observe(call.started_at - call.queued_at)
                m.compute.observe(call.finished_at - call.started_at)
                m.prompt_tokens.inc(result.prompt_len)
                m.cached_tokens.inc(result.cached_tokens)
            resolve_answer(result)

        call = PrefillCall(handoff_request, on_answer, _resolver(loop, first))
        context.add_done_callback(lambda _context: call.cancel())
        self.open_calls += 1
        try:
            try:
                self.scheduler.submit(call)
            except QueueFull as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._busy(str(e)))
            async for message in self._stream(request, call, answer, first, context):
                yield message
        finally:
            self.open_calls -= 1
            call.cancel()  # a no-op once answered; otherwise the scheduler drops it

    def _busy(self, why: str) -> str:
        return f"prefill replica busy: {why} (--max-open-calls {self.config.max_open_calls}); retry later or elsewhere"

    def _parse(self, request: prefill_pb2.PrefillRequest) -> HandoffRequest:
        """The request as a HandoffRequest; ValueError naming what is wrong."""
        request_bounds.check(request, self.config.max_chunk_bytes, self.runner.config)  # before any copy
        sp = request.sampling_params
        # prefill samples one token: validate against that, whatever the request's decode budget is
        params = SamplingParams(
            max_new_tokens=1,
            temperature=sp.temperature,
            top_k=sp.top_k,
            top_p=sp.top_p or 1.0,
            min_p=sp.min_p,
            seed=sp.seed,
            stop_token_ids=stop_token_ids(sp.stop_token_ids),
        )
        prompt = list(request.input_ids)
        validate_prompt(
            prompt,
            params,
            self.runner.config.vocab_size,
            self.runner.context_length,
            kv_capacity=self.runner.kv_allocator.size,
        )
        if request.first_output_position >= len(prompt):
            raise ValueError("first_output_position must be < len(input_ids)")
        params.min_new_tokens = sp.min_new_tokens  # masks EOS / stop ids if first_output_position is below it
        return HandoffRequest(request.request_id, prompt, params, sp.seed, request.first_output_position)

    async def _stream(self, request, call: PrefillCall, answer: asyncio.Future, first: asyncio.Future, context):
        m = self.metrics
        try:  # the first token goes out as soon as it is sampled, while the KV is still copied out
            await asyncio.wait({answer, first}, return_when=asyncio.FIRST_COMPLETED)
            sent = first.result() if first.done() and not call.cancelled.is_set() else None
            if sent is not None:
                yield prefill_pb2.PrefillChunk(first_token=prefill_pb2.FirstToken(token_id=sent))
            result = await answer
        except (asyncio.CancelledError, GeneratorExit):  # the caller went away (closed at a yield) or we stop
            m.failures.inc()
            raise
        if call.cancelled.is_set() or isinstance(result, Exception):
            m.failures.inc()
            if not call.cancelled.is_set():
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {result}")
            return
        if sent is None:
            yield prefill_pb2.PrefillChunk(first_token=prefill_pb2.FirstToken(token_id=result.first_token))
        sent_first = time.perf_counter()
        max_bytes = kv_chunks.chunk_bound(request.max_chunk_bytes, self.config.max_chunk_bytes)  # checked in _parse
        fault = self.faults.draw()
        if fault:
            m.injected.labels(kind=fault).inc()
        dest = request.kv_destination if request.HasField("kv_destination") else None
        # into decode's slots where this replica reaches them, else bytes on the stream
        backend, messages = self.sender.messages(request.request_id, dest, result, max_bytes, call.cancelled.is_set)
        loop = asyncio.get_running_loop()
        outbox = Outbox(messages, result)
        count = 0
        nbytes = 0
        draft_seed = None
        self.transfers_in_flight += 1
        try:
            while draft_seed is None:  # the seed comes with the last message
                try:
                    message, draft_seed = await loop.run_in_executor(self._chunk_pool, outbox.take)
                except KvTransferError as e:
                    m.failures.inc()
                    m.kv_transfer_failures.inc()
                    logger.warning("KV transfer of %s failed: %s", request.request_id, e)
                    await context.abort(grpc.StatusCode.INTERNAL, f"KV transfer failed: {e}")
                if message is None:
                    continue
                if call.cancelled.is_set():
                    m.failures.inc()
                    return
                if self.config.test_kv_chunk_delay_s:
                    await asyncio.sleep(self.config.test_kv_chunk_delay_s)
                count += 1
                size = message.written.bytes if message.HasField("written") else kv_chunks.payload_bytes(message.kv)
                nbytes += size
                self.kv_notices += message.HasField("written")
                m.handoff_bytes.labels(backend=backend).inc(size)
                yield message
                if count == 1 and fault:
                    m.failures.inc()
                    if fault == "fail":
                        await context.abort(grpc.StatusCode.INTERNAL, "injected handoff failure")
                    # a stall: hold the call open, sending nothing, until the caller cancels (or the server stops)
                    await asyncio.sleep(STALL_MAX_S)
                    return
        finally:
            self.transfers_in_flight -= 1
        yield prefill_pb2.PrefillChunk(
            record=prefill_pb2.PrebuiltRecord(
                prompt_len=len(result.prompt_ids),
                first_token=result.first_token,
                num_kv_chunks=count,
                draft_seed=draft_seed,
                queue_us=int(1e6 * (call.started_at - call.queued_at)),
                compute_us=int(1e6 * (call.finished_at - call.started_at)),
                cached_tokens=result.cached_tokens,
            )
        )
        elapsed = time.perf_counter() - sent_first
        m.observe_transfer(elapsed, nbytes)
        m.requests.inc()
        self._trace(context, call, sent_first, nbytes)

    def _trace(self, context, call: PrefillCall, sent_first: float, nbytes: int) -> None:
        """The call's spans, under the decode side's prefill_call span (traceparent metadata)."""
        parent = self.tracing.extract(context.invocation_metadata())
        if parent is None:
            return
        t = tracing.wall_ns
        span = self.tracing.start("prefill", parent, t(call.queued_at), rid=call.request.rid)
        inner = self.tracing.context_of(span)
        self.tracing.record("queue", inner, t(call.queued_at), t(call.started_at))
        self.tracing.record("compute", inner, t(call.started_at), t(call.finished_at))
        self.tracing.record("transfer", inner, t(sent_first), time.time_ns(), bytes=nbytes)
        span.end()

    async def GetLoad(self, request, context):
        kv = self.runner.kv_allocator
        return prefill_pb2.LoadResponse(
            num_running_reqs=self.scheduler.num_running,
            num_waiting_reqs=self.scheduler.num_queued(),
            num_used_tokens=kv.num_used,
            max_total_tokens=kv.size,
        )


def _resolver(loop: asyncio.AbstractEventLoop, answer: asyncio.Future):
    """A call's `on_answer`: from any thread, resolve `answer` on `loop` (unless it was cancelled)."""

    def resolve(result: Answer) -> None:
        if not answer.done():
            answer.set_result(result)

    def on_answer(result: Answer) -> None:
        try:
            loop.call_soon_threadsafe(resolve, result)
        except RuntimeError:  # the server's loop is closed: nobody waits for this answer any more
            pass

    return on_answer
