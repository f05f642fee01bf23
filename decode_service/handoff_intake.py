"""HandoffIntake: how the decode scheduler takes in what a prefill replica sends (an object it holds; the
scheduler hands it every prefill reply from its inbox, `take(msg)`).

A prefill replica is trusted with nothing but its own request. Each reply is checked where it enters:
the first token is an id of the vocabulary; a KV chunk fits the pools and the reservation
(handoff_writes.check_kv, before anything is written); the handoff's record fits the request
(first token, positions, cached tokens, `Handoff.check_continues`) and, with EAGLE, its seed is
sound (top-k ids in the vocabulary, finite probabilities and hidden of the target's width); under a
grammar, every first token (streamed or in the record) and resent output is one it allows. A reply
that fails a check, or any exception while one is handled, ends that request with an error
(`_fail_reply`: freed once, now or at the prefill's last word while a transfer engine may still
write its slots); only our own books (InvariantError) or a failed stream stop the scheduler. A handoff
from decode's cached prefix that the replica refused (ErrorKind.KV_START_REFUSED) is asked for again,
whole (`scheduler.refetch_whole`).
"""

from __future__ import annotations

import logging

from common.engine.handoff import check_token
from common.engine.streams import StreamFailed
from common.request_rules import ErrorKind, FinishReason
from decode_service.grammar_state import check_outputs
from decode_service.inbox import FirstTokenArrived, HandoffArrived, HandoffFailed, KvChunkArrived
from decode_service.req import ReqState
from decode_service.scheduler_types import InvariantError

logger = logging.getLogger(__name__)


def bad_reply(rid: str, e: Exception) -> str:
    """A request's error for a bad prefill reply (a ValueError is a failed check; anything else is logged)."""
    if not isinstance(e, ValueError):
        logger.error("handling a prefill reply for %s failed", rid, exc_info=e)
    return f"bad reply from prefill: {e}"


class HandoffIntake:
    def __init__(self, reqs: dict, worker, abort_waits_for_prefill: bool, ends):
        """`reqs`: the scheduler's request table; `worker`: lands KV chunks (its `info` bounds what is
        checked); `abort_waits_for_prefill`: a transfer engine may write reserved slots until the prefill's
        last word; `ends`: the scheduler, whose `finish`, `release`, `emit`, `finish_reason` end requests,
        whose `queue_prebuilt` takes a request whose handoff is in and whose `refetch_whole` re-queues one
        whose handoff from the cached prefix was refused."""
        self.reqs, self.worker, self.ends = reqs, worker, ends
        self.info, self.spec = worker.info, worker.info.spec
        self.abort_waits_for_prefill = abort_waits_for_prefill
        self._handlers = {
            FirstTokenArrived: self._on_first_token,
            KvChunkArrived: self._on_kv_chunk,
            HandoffArrived: self._on_handoff,
            HandoffFailed: self._on_handoff_failed,
        }

    def takes(self, msg) -> bool:
        return type(msg) in self._handlers

    def take(self, msg) -> None:
        """Apply one prefill reply; a failure is the request's, not the scheduler's."""
        try:
            self._handlers[type(msg)](msg)
        except (InvariantError, StreamFailed):
            raise  # our own books or the device broke: that is the scheduler's
        except Exception as e:
            if isinstance(msg, KvChunkArrived) and msg.done is not None:
                msg.done()  # open the sender's window (a no-op if the stream already did)
            self._fail_reply(msg.rid, bad_reply(msg.rid, e), isinstance(msg, (HandoffArrived, HandoffFailed)))

    def _awaiting(self, rid: str):
        """The request `rid` if it awaits its handoff (None once it moved on, or was freed)."""
        req = self.reqs.get(rid)
        return req if req is not None and req.state == ReqState.AWAITING_HANDOFF else None

    def _on_first_token(self, msg: FirstTokenArrived) -> None:
        req = self._awaiting(msg.rid)
        if req is None or req.finished or msg.position != len(req.output_ids):
            return  # gone (or aborted), or a retry's resend of a token already streamed
        if req.params.n > 1:
            return  # the record brings every sample's first token (sample_group.py)
        if req.output_ids and self.ends.finish_reason(req) is not None:
            return  # never stream a token past a finish
        check_token(msg.rid, "first token", msg.token, self.info.vocab_size)  # ValueError: _fail_reply
        check_outputs(req, req.output_ids, [msg.token])  # before it is streamed
        req.output_ids.append(msg.token)
        if req.params.return_logprob:  # its logprobs come with the record (first_token.py)
            req.held_first = True
            return
        self.ends.emit(req, [msg.token], None)

    def _on_kv_chunk(self, msg: KvChunkArrived) -> None:
        req = self._awaiting(msg.rid)
        if req is None or req.finished:  # gone: drop it, but open the sender's window all the same
            if msg.done is not None:
                msg.done()
            return
        draft = msg.draft and self.spec is not None  # a ValueError (checked, nothing written): _fail_reply
        slots = req.kv_slots[req.prefix_len :]  # chunks count from the first position decode's cache lacks
        self.worker.write_kv_chunk(slots, msg.token_start, msg.layer_start, msg.k, msg.v, draft, msg.done)

    def _on_handoff(self, msg: HandoffArrived) -> None:
        handoff = msg.handoff
        req = self._awaiting(handoff.rid)
        if req is None:
            return  # aborted or failed meanwhile: its reservation is already freed
        if req.finished:  # aborted while its KV was being written: now nothing writes there any more
            self.ends.release(req)
            return
        # a ValueError here (a malformed record) is this request's: _fail_reply frees it
        handoff.check_record(self.info.vocab_size)
        if handoff.k is not None:  # KV in the record (in-process); else it came as chunks
            handoff.check(self.info.num_layers)
        if self.spec:
            handoff.check_draft(self.info.hidden_size, self.info.vocab_size)
        handoff.check_continues(req.prompt_ids, req.output_ids)
        resent = handoff.prompt_ids[handoff.prompt_len - handoff.first_position :]  # the grammar accepts them all
        check_outputs(req, resent, [handoff.first_token, *handoff.more_first_tokens])
        req.handoff = handoff
        self.ends.queue_prebuilt(req)

    def _on_handoff_failed(self, msg: HandoffFailed) -> None:
        req = self._awaiting(msg.rid)
        if req is not None and req.finished:  # aborted earlier; its prefill has ended now
            self.ends.release(req)
        elif req is not None and msg.kind == ErrorKind.KV_START_REFUSED and req.prefix_len:
            self.ends.refetch_whole(req, msg.error)  # decode's cached prefix not taken: ask for the whole prompt
        elif req is not None:
            self.ends.finish(req, FinishReason.ERROR, msg.error, msg.kind)

    def _fail_reply(self, rid: str, detail: str, last_word: bool) -> None:
        """A prefill reply for `rid` was bad: the request ends with an error, once. Its slots are freed
        now, or, while a transfer engine may still write into them, at the prefill's last word on it
        (its handoff or failure: `last_word` says this reply was that)."""
        req = self._awaiting(rid)
        if req is None:
            return  # gone meanwhile: already freed
        if last_word or not self.abort_waits_for_prefill:
            if req.finished:
                self.ends.release(req)
            else:
                self.ends.finish(req, FinishReason.ERROR, detail)
        elif not req.finished:  # the client hears it now; _on_handoff(_failed) releases it later
            req.finish_reason, req.error = FinishReason.ERROR, detail
            self.ends.emit(req, [], FinishReason.ERROR)
