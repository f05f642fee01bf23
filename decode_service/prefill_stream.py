"""One prefill attempt's stream, read message by message into the Handoff.

`HandoffStream.add` checks each message and forwards it to the sink: the first token at once (and
appended to the tokens already sent, if it is the one at the next output position), each KV chunk
(ranges, shapes, exactly-once coverage) to be written into the reserved slots, at most
MAX_PENDING_CHUNKS of them not yet written, a `written` notice (the replica wrote that KV into our
slots) checked for coverage the same way, and the record last. `finish` gives the Handoff the record
described. Anything out of order, twice, or not covering the prompt raises ValueError: the attempt is
broken and the call retries it elsewhere.
"""

from __future__ import annotations

import threading
import time

from common.engine.handoff import Handoff, HandoffRequest, check_token
from common.wire import kv_chunks
from common.wire.kv_chunks import KvAssembler, decode_more_draft, decode_seed
from common.wire.logprobs_codec import logprobs_from_wire, more_logprobs_from_wire, prompt_logprobs_from_wire

MAX_PENDING_CHUNKS = 4  # per call: KV chunks handed to the scheduler and not yet written into the pool


class HandoffStream:
    def __init__(
        self, request: HandoffRequest, sent: list[int], sink, config, draft_config, chunk_wait_s: float, metrics
    ):
        """`sent`: the tokens the client already has (the first token is appended as it is forwarded);
        `config` / `draft_config`: the model's and EAGLE head's layer shapes; `chunk_wait_s`: how long a
        KV chunk may wait for the scheduler to take one of the window's chunks."""
        self.request, self.sent, self.sink = request, sent, sink
        self.config, self.draft_config, self.metrics = config, draft_config, metrics
        self.chunk_wait_s = chunk_wait_s
        n = len(request.prompt_ids) - request.kv_start  # the positions whose KV comes (kv_start..)
        cfg, draft = config, draft_config
        self.assembler = KvAssembler(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, store=False, v_dim=cfg.v_dim)
        self.draft_assembler = (
            KvAssembler(n, 1, draft.num_kv_heads, draft.head_dim, store=False, v_dim=draft.v_dim) if draft else None
        )
        self.first: int | None = None
        self.started: float | None = None  # perf_counter time of the first message
        self.nbytes = 0  # KV bytes streamed or written by the replica
        self.handoff: Handoff | None = None
        self.window = threading.Semaphore(MAX_PENDING_CHUNKS)  # chunks delivered but not yet written

    def add(self, chunk) -> None:
        self.started = self.started or time.perf_counter()
        kind = chunk.WhichOneof("payload")
        if self.handoff is not None:  # the record comes last: anything after it is a broken stream
            raise ValueError(f"prefill stream sent {kind or 'an empty message'} after its record")
        if kind == "first_token":
            self._first_token(chunk.first_token.token_id)
        elif kind == "kv":
            self._kv(chunk.kv)
        elif kind == "written":
            w = chunk.written
            self._assembler(w.draft).cover(w.token_start, w.num_tokens, w.layer_start, w.num_layers)
            self.nbytes += w.bytes
        elif kind == "record":
            self._record(chunk.record)
        else:
            raise ValueError(f"prefill stream sent an unknown message ({kind or 'empty'})")

    def finish(self) -> Handoff:
        if self.handoff is None:
            raise ValueError("prefill stream ended without a record")
        return self.handoff

    def _assembler(self, draft: bool) -> KvAssembler:
        if not draft:
            return self.assembler
        if self.draft_assembler is None:
            raise ValueError("draft KV from a prefill replica, but speculative decoding is off here")
        return self.draft_assembler

    def _first_token(self, token: int) -> None:
        request = self.request
        if self.first is not None:
            raise ValueError("prefill stream sent a second first token")
        check_token(request.rid, "first token", token, self.config.vocab_size)
        self.first = token
        if request.params.n > 1:
            return  # the record brings every sample's first token; a retry re-prefills the prompt alone
        if len(self.sent) == request.first_position:
            self.sent.append(token)
        self.sink.deliver_first_token(request.rid, token, request.first_position)

    def _kv(self, kv) -> None:
        k, v = self._assembler(kv.draft).add(kv)
        self.nbytes += kv_chunks.payload_bytes(kv)
        if not self.window.acquire(timeout=self.chunk_wait_s):  # gRPC flow control holds upstream
            raise ValueError(f"decode took no KV chunk for {self.chunk_wait_s:g}s")
        self.sink.deliver_kv(self.request.rid, kv.token_start, kv.layer_start, k, v, kv.draft, self.window.release)

    def _record(self, rec) -> None:
        request, cfg, n = self.request, self.config, len(self.request.prompt_ids)  # the record counts them all
        self.assembler.finish()
        chunks = self.assembler.chunks
        if self.draft_assembler is not None:  # the head's KV must cover the prompt too
            self.draft_assembler.finish()
            chunks += self.draft_assembler.chunks
        if rec.prompt_len != n or rec.num_kv_chunks != chunks:
            raise ValueError(f"record says {rec.prompt_len} tokens / {rec.num_kv_chunks} chunks, got {n} / {chunks}")
        if self.first is not None and rec.first_token != self.first:
            raise ValueError("record's first token differs from the streamed one")
        if self.metrics is not None:
            self.metrics.observe_transfer(time.perf_counter() - self.started, self.nbytes)
            self.metrics.handoff_bytes.inc(self.nbytes)
        handoff = Handoff(
            request.rid,
            request.prompt_ids,
            request.params,
            request.seed,
            rec.first_token,
            k=None,
            v=None,
            first_position=request.first_position,
            kv_start=request.kv_start,
            cached_tokens=rec.cached_tokens,
            first_logprobs=logprobs_from_wire(rec, request.params, self.config.vocab_size),
            more_first_tokens=tuple(rec.more_first_tokens),  # n > 1 (count and ids: check_record)
            more_first_logprobs=more_logprobs_from_wire(rec, request.params, self.config.vocab_size),
            prompt_logprobs=prompt_logprobs_from_wire(rec, request.params, self.config.vocab_size),
            **decode_seed(rec),
            **decode_more_draft(rec),  # EAGLE, n > 1 (rows and values: check_draft)
        )
        handoff.check_record(cfg.vocab_size)
        if self.draft_config is not None:
            handoff.check_draft(cfg.hidden_size, cfg.vocab_size)
        self.handoff = handoff
