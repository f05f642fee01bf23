"""One Generate call's answer: the scheduler's RequestOutputs (decode_service/output.py) turned into
smg's GenerateResponse messages, with the call's metrics and its decode span on the way.

A streaming call gets a chunk of the new ids whenever a record brings some, then one Complete; a
non-streaming call gets only the Complete, with every id. With n > 1 every sample has its chunks and
its Complete, tagged with its `index` (smg's contract), and the answer ends after the n-th Complete.
A call with return_logprob gets each chunk's logprobs in the chunk and every id's in the Complete
(`output_logprobs`); with prompt logprobs (logprob_start_len >= 0) the first chunk and the Complete of
sample 0 carry them too (`input_logprobs`): once per call, as they are the same for every sample (with
n = 32 and a long prompt, a copy per sample would multiply the call's bytes by 32). A sample's finish
ends its answer:
  - "stop" / "length" / "abort": the Complete (reason, matched stop, cached prompt tokens, EAGLE's
    accepted and proposed drafts);
  - "abort" while the service drains: UNAVAILABLE (the call was cut short by the shutdown);
  - "error": UNAVAILABLE (a broken handoff, retryable), INTERNAL when the scheduler itself died,
    INVALID_ARGUMENT when the prefill side refused the request (ErrorKind.REFUSED: not retryable).
A scheduler that dies without a record for the call ends it with INTERNAL within a second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common import tracing
from common.request_rules import ErrorKind, FinishReason
from decode_service.admission import Rejected
from decode_service.output import Finish, RequestOutput


class _Sample:
    """One sample's answer so far (n > 1 has n of them): its ids, their logprobs, its times."""

    def __init__(self, started: float, logprobs: bool):
        self.ids: list[int] = []
        self.logprobs: list | None = [] if logprobs else None  # TokenLogprobs of every id so far
        self.prompt = None  # the prompt logprobs, once the first record brought them (when asked)
        self.first_at = self.last = started


class Responder:
    def __init__(self, scheduler, metrics, tracer: tracing.Tracing, spec_steps: int, draining: Callable[[], bool]):
        self.scheduler, self.metrics, self.tracing = scheduler, metrics, tracer
        self.spec_steps = spec_steps  # --speculative-num-steps: drafts per verify step
        self.draining = draining

    async def stream(self, request, ids, outputs: asyncio.Queue, trace) -> AsyncIterator[pb.GenerateResponse]:
        """The call's responses from the RequestOutputs its scheduler callback puts on `outputs`; with
        n > 1 each sample's chunks and Complete carry its `index`, and the answer ends after n Completes."""
        m, started = self.metrics, time.perf_counter()
        samples = [_Sample(started, request.return_logprob) for _ in range(max(1, request.sampling_params.n))]
        still_open = len(samples)
        while still_open:
            out = await self._next(outputs)
            if out is None:
                continue
            s, tokens, finish = samples[out.index], out.new_token_ids, out.finish
            reason = finish.reason if finish is not None else None
            if tokens:
                now = time.perf_counter()
                if not any(x.ids for x in samples):
                    m.ttft.observe(now - started)
                if not s.ids:
                    s.first_at = now
                for _ in range(len(tokens) - 1 if not s.ids else len(tokens)):
                    m.itl.observe((now - s.last) / len(tokens))
                s.last = now
                m.generation_tokens.inc(len(tokens))
            s.ids.extend(tokens)
            if s.logprobs is not None:
                s.logprobs.extend(out.logprobs or ())
            prompt_logprobs = out.prompt_logprobs if out.index == 0 else None  # once per call
            if prompt_logprobs is not None:
                s.prompt = prompt_logprobs
            if reason is not None:
                m.count_finish(reason, len(ids) if out.index == 0 else 0, started, s.first_at, len(s.ids))
                if s.ids and self.tracing.enabled:
                    parent = trace[0] if trace is not None else None
                    self.tracing.record(
                        "decode", parent, tracing.wall_ns(s.first_at), time.time_ns(), tokens=len(s.ids)
                    )
            if reason == FinishReason.ERROR:
                raise Rejected(*self._failure(finish))
            if reason == FinishReason.ABORT and self.draining():
                raise Rejected(grpc.StatusCode.UNAVAILABLE, "server shut down before the request finished")
            if tokens and request.stream:
                chunk = pb.GenerateStreamChunk(
                    token_ids=tokens, prompt_tokens=len(ids), completion_tokens=len(s.ids), index=out.index
                )
                if out.logprobs is not None:
                    chunk.output_logprobs.CopyFrom(output_logprobs(tokens, out.logprobs, request))
                if prompt_logprobs is not None:
                    chunk.input_logprobs.CopyFrom(input_logprobs(ids, prompt_logprobs, request))
                yield pb.GenerateResponse(request_id=request.request_id, chunk=chunk)
            if finish is not None:
                complete = self._complete(finish, ids, s.ids)
                complete.index = out.index
                if s.logprobs is not None and finish.reason in (FinishReason.STOP, FinishReason.LENGTH):
                    complete.output_logprobs.CopyFrom(output_logprobs(s.ids, s.logprobs, request))
                    if s.prompt is not None:
                        complete.input_logprobs.CopyFrom(input_logprobs(ids, s.prompt, request))
                yield pb.GenerateResponse(request_id=request.request_id, complete=complete)
                still_open -= 1

    async def _next(self, outputs: asyncio.Queue) -> RequestOutput | None:
        """The next record, or None after a quiet second (never wait forever on a scheduler that died).
        Not `asyncio.wait_for`: before Python 3.12 it drops a cancellation that arrives as the queue
        hands over a record, and the call's records come every step, so a client that went away was
        often decoded to the end instead of aborted."""
        if not outputs.empty():
            return outputs.get_nowait()
        getter = asyncio.ensure_future(outputs.get())
        try:
            done, _ = await asyncio.wait({getter}, timeout=1.0)
        finally:
            if not getter.done():
                getter.cancel()  # a cancelled get takes nothing from the queue
        if done:
            return getter.result()
        if not self.scheduler.alive:
            raise Rejected(grpc.StatusCode.INTERNAL, f"decode scheduler failed: {self.scheduler.fatal_error!r}")
        return None

    def _failure(self, finish: Finish) -> tuple[grpc.StatusCode, str]:
        detail = finish.error or repr(self.scheduler.fatal_error)
        code = grpc.StatusCode.INTERNAL if not self.scheduler.alive else grpc.StatusCode.UNAVAILABLE
        if finish.error_kind == ErrorKind.REFUSED:  # not retryable: the client must change the request
            code = grpc.StatusCode.INVALID_ARGUMENT
        return code, f"request failed: {detail}"

    def _complete(self, finish: Finish, ids: list[int], all_ids: list[int]) -> pb.GenerateComplete:
        accepted, drafted = finish.spec_accepted, finish.spec_drafted
        if drafted:
            m = self.metrics
            m.spec_accepted.inc(accepted)
            m.spec_drafted.inc(drafted)
            m.spec_accept_length.observe(1 + accepted * self.spec_steps / drafted)
        complete = pb.GenerateComplete(
            output_ids=all_ids,
            finish_reason=finish.reason,
            prompt_tokens=len(ids),
            completion_tokens=len(all_ids),
            cached_tokens=finish.cached_tokens,
            spec_accepted_tokens=accepted,
            spec_draft_tokens=drafted,
        )
        if finish.matched_stop is not None:
            complete.matched_token_id = finish.matched_stop
        elif finish.matched_stop_str is not None:
            complete.matched_stop_str = finish.matched_stop_str
        return complete


def output_logprobs(ids: list[int], logprobs, request) -> pb.OutputLogProbs:
    """smg's OutputLogProbs of `ids` and their TokenLogprobs (common/engine/logprobs.py): one row per id
    of top candidates, and of the request's token_ids_logprob when it named any."""
    msg = pb.OutputLogProbs(token_logprobs=[lp.logprob for lp in logprobs], token_ids=ids)
    for lp in logprobs:
        msg.top_logprobs.add(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top])
        if request.token_ids_logprob:
            msg.token_ids_logprobs.add(values=list(lp.ids), token_ids=list(request.token_ids_logprob))
    return msg


def input_logprobs(ids: list[int], values, request) -> pb.InputLogProbs:
    """smg's InputLogProbs of the prompt `ids` from logprob_start_len = s, as SGLang's servicer fills it:
    one entry per prompt id from s, position 0 (when s = 0) without a value and with no candidates;
    the other positions' `values` (Handoff.prompt_logprobs) with their top candidates when asked. The
    proto has no field for the token_ids_logprob values of prompt positions (in-process they are in
    the TokenLogprobs)."""
    start, top = request.logprob_start_len, request.top_logprobs_num > 0
    msg = pb.InputLogProbs(token_ids=ids[start:])
    if start == 0:
        msg.token_logprobs.add()
        if top:
            msg.top_logprobs.add()
    for lp in values:
        msg.token_logprobs.add(value=lp.logprob)
        if top:
            msg.top_logprobs.add(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top])
    return msg
