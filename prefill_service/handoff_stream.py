"""One Prefill call's handoff stream: the first token, the KV through the sender, the record.

`HandoffStreams.stream(...)` is the response stream of one call the server has submitted to the
scheduler, an async generator on the server's event loop:
  1. the first token as soon as the scheduler samples it (the call's `first` future), while the KV
     is still copied out; if the answer (`answer`) comes first, its first token instead. An answer
     that is an error ends the call with INTERNAL; a cancelled call sends nothing more;
  2. the KV part that the KV sender makes (common/kv_transfer/sender.py): KvChunks on the stream,
     or KvWritten notices after writes into decode's slots when the call names a destination this
     replica reaches, each bounded by the call's max_chunk_bytes. The sender's messages block, so
     they are taken one at a time on a small pool of single-intra-op threads (outbox.py). A
     KvTransferError ends the call with INTERNAL;
  3. the PrebuiltRecord: prompt length, first token (and with n > 1 those of samples 1..n-1; the
     early FirstToken is sample 0's alone), how many KV messages came before it, queue and compute
     times, cached tokens, first tokens' logprobs, and with EAGLE the draft seed;
  4. the books: handoff bytes by backend, transfer time and size, requests or failures, and the
     call's spans under decode's prefill_call span (the call's traceparent metadata).
Hooks (hooks.py; None in production): `before_kv_message` before each KV message, and one
`draw_fault` per call: a FAIL ends the call with INTERNAL after its first KV message, a STALL holds
it open after that message, sending nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from common import tracing
from common.forward import intra_op
from common.kv_transfer.errors import KvTransferError
from common.kv_transfer.sender import KvSender
from common.metrics import PrefillMetrics
from common.wire import kv_chunks
from common.wire.logprobs_codec import logprobs_to_wire, more_logprobs_to_wire, prompt_logprobs_to_wire
from common.wire.proto_gen import prefill_pb2
from prefill_service.hooks import FAIL, STALL_MAX_S, PrefillHooks
from prefill_service.outbox import Outbox
from prefill_service.scheduler import PrefillCall

logger = logging.getLogger(__name__)


class HandoffStreams:
    """What every call's stream shares: the sender, the books, the transfer threads, the hooks."""

    def __init__(
        self,
        sender: KvSender,
        metrics: PrefillMetrics,
        tracer: tracing.Tracing,
        max_chunk_bytes: int,
        hooks: PrefillHooks | None = None,
    ):
        self.sender, self.metrics, self.tracing, self.hooks = sender, metrics, tracer, hooks
        self.max_chunk_bytes = max_chunk_bytes  # this replica's bound; a call may ask for less
        self.transfers_in_flight = 0  # calls between their first token and their record (event loop only)
        self.kv_notices = 0  # KvWritten notices sent since start (KV written through the transfer engine)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-chunks", initializer=intra_op.pin_single)

    def close(self) -> None:
        """Drop the transfer threads' queued work (the streams are over or cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def stream(self, request, call: PrefillCall, answer: asyncio.Future, first: asyncio.Future, context):
        """The call's messages; `first` and `answer` are resolved on this loop by the scheduler's thread."""
        m, hooks = self.metrics, self.hooks
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
        max_bytes = kv_chunks.chunk_bound(request.max_chunk_bytes, self.max_chunk_bytes)  # checked by the server
        fault = hooks.draw_fault() if hooks is not None else None
        if fault:
            m.injected.labels(kind=fault).inc()
        dest = request.kv_destination if request.HasField("kv_destination") else None
        # into decode's slots where this replica reaches them, else bytes on the stream
        backend, messages = self.sender.messages(request.request_id, dest, result, max_bytes, call.cancelled.is_set)
        loop = asyncio.get_running_loop()
        outbox = Outbox(messages, result)
        count = nbytes = 0
        draft_seed = None
        self.transfers_in_flight += 1
        try:
            while draft_seed is None:  # the seed comes with the last message
                try:
                    message, draft_seed = await loop.run_in_executor(self._pool, outbox.take)
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
                if hooks is not None:
                    await hooks.before_kv_message()
                count += 1
                written = message.HasField("written")
                size = message.written.bytes if written else kv_chunks.payload_bytes(message.kv)
                nbytes += size
                self.kv_notices += written
                m.handoff_bytes.labels(backend=backend).inc(size)
                yield message
                if count == 1 and fault:
                    m.failures.inc()
                    if fault == FAIL:
                        await context.abort(grpc.StatusCode.INTERNAL, "injected handoff failure")
                    # a stall: hold the call open, sending nothing, until the caller cancels (or the server stops)
                    await asyncio.sleep(STALL_MAX_S)
                    return
        finally:
            self.transfers_in_flight -= 1
        yield _record(call, result, count, draft_seed)
        m.observe_transfer(time.perf_counter() - sent_first, nbytes)
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


def _record(call: PrefillCall, result, count: int, draft_seed) -> prefill_pb2.PrefillChunk:
    """The stream's last message: what decode needs to admit the request without a forward."""
    return prefill_pb2.PrefillChunk(
        record=prefill_pb2.PrebuiltRecord(
            prompt_len=len(result.prompt_ids),
            first_token=result.first_token,
            num_kv_chunks=count,
            draft_seed=draft_seed,
            queue_us=int(1e6 * (call.started_at - call.queued_at)),
            compute_us=int(1e6 * (call.finished_at - call.started_at)),
            cached_tokens=result.cached_tokens,
            first_logprobs=logprobs_to_wire(result.first_logprobs),
            more_first_tokens=result.more_first_tokens,  # n > 1: samples 1..n-1
            more_first_logprobs=more_logprobs_to_wire(result.more_first_logprobs),
            prompt_logprobs=prompt_logprobs_to_wire(result.prompt_logprobs),
            more_draft=kv_chunks.encode_more_draft(result),  # EAGLE, n > 1: samples 1..n-1 at the last position
        )
    )
