"""KV grown on demand on decode, and retraction when the pool runs dry (an object the scheduler holds).

`--decode-kv-reservation`:
- `full`: admission reserves prompt + max_new_tokens (+ EAGLE's draft window) for every sample; a
  running request never needs more, and never grows. What a client declares costs its KV, used or not.
- `on-demand` (the default): admission reserves the KV the handoff lands in (the prompt, plus the
  outputs a retracted request resends) and `grow` slots more, and leaves `grow` slots free per request
  already holding KV. Before each step is launched (`before_launch`), every request of the step holds
  slots for every position the step may write: its committed length, EAGLE's draft window, one more;
  it grows `grow` slots at a time and never past its full reservation. The row's new slots are mapped
  on the worker's stream (`extend_row`) ahead of the step, so a launched step never runs out of KV.

Retraction (SGLang's retract_decode, vLLM's preemption by recompute): when a growth cannot be
allocated, a running request of the step is retracted: the one with the fewest output tokens (the
least to recompute), the longest prompt first among equals, never one retracted MAX_RETRACTIONS times
already (the requester itself may be the one). A retracted request frees its slots and request slot
at once (stream work: the steps already launched that read them run first), leaves the step, and
goes back to the head of `waiting` (scheduler.retract); admitted again, it is prefilled from prompt +
the outputs sent so far, sampled at its next output position, so the client sees no token twice and
none changed (the path a prefill retry takes). Under overlap the retracted request's lane in the step
still in flight is processed as usual (its token streamed, and resent with the rest). A requester
that cannot grow and has no request left to retract ends with an error naming the pool.
`hooks.retract(step, reqs)` (tests: DecodeHooks) names requests to retract before a step as if the
pool had run dry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from common.engine.handoff import HandoffRequest
from decode_service.req import DecodeReq

FULL, ON_DEMAND = "full", "on-demand"
MAX_RETRACTIONS = 2  # a request retracted this often is not retracted again (it runs, or the requester fails)


class KvGrowth:
    def __init__(self, books, worker, mode: str = ON_DEMAND, grow: int = 32, hooks=None, metrics=None):
        """`books`: the scheduler's SlotBooks; `worker`: maps grown slots (`extend_row`)."""
        if mode not in (FULL, ON_DEMAND):
            raise ValueError(f"--decode-kv-reservation must be {FULL} or {ON_DEMAND}, got {mode!r}")
        if grow < 1:
            raise ValueError(f"--decode-kv-grow-tokens must be >= 1, got {grow}")
        self.books, self.worker, self.mode, self.grow = books, worker, mode, grow
        self.hooks, self.metrics = hooks, metrics
        self.retractions = 0  # requests retracted so far
        self.reprefilled = 0  # output tokens they resent to prefill

    @property
    def on_demand(self) -> bool:
        return self.mode == ON_DEMAND

    def admission_outputs(self, req: DecodeReq) -> int:
        """Output slots a sample reserves at admission, past what its handoff lands in."""
        left = req.params.max_new_tokens - len(req.output_ids)
        return min(self.grow, left) if self.on_demand else left

    def keep_free(self, holders: int) -> int:
        """Slots admission leaves free while `holders` requests hold KV (each one growth's worth)."""
        return holders * self.grow if self.on_demand else 0

    def full_len(self, req: DecodeReq) -> int:
        """A request's full reservation: the most KV it can ever use (its row never maps more)."""
        return req.prompt_len + req.params.max_new_tokens + self.books.extra

    def before_launch(
        self, step: int, reqs: list[DecodeReq], committed: list[int], retract: Callable[[DecodeReq], None], fail
    ) -> None:
        """Grow every request of the step to what the step may write, retracting (`retract`) where the
        pool runs dry; `fail(req, detail)` ends a requester that can neither grow nor retract anyone."""
        if not self.on_demand:
            return
        if self.hooks is not None:
            for req in self.hooks.retract(step, list(reqs)):
                self._retract(req, retract)
        for req, length in zip(reqs, committed):
            if req.kv_slots is None or req.finished:
                continue  # retracted above, or finished meanwhile
            need = min(length + self.books.extra + 1, self.full_len(req))
            have = len(req.kv_slots)
            if need <= have:
                continue
            target = min(max(need, have + self.grow), self.full_len(req))
            while (new := self._grow(req, need, target)) is None:
                victim = self._victim(reqs)
                if victim is None:
                    fail(req, self._dry(req, target - have))
                    break
                self._retract(victim, retract)
                if victim is req:
                    break
            else:
                self.worker.extend_row(req.req_pool_idx, have, new)

    def _grow(self, req: DecodeReq, need: int, target: int):
        """New slots taking `req` to `target` positions, or to `need` where only that many are free."""
        new = self.books.grow(req, target)
        return new if new is not None else self.books.grow(req, need)

    def _victim(self, reqs: list[DecodeReq]) -> DecodeReq | None:
        live = [r for r in reqs if r.kv_slots is not None and not r.finished and r.retractions < MAX_RETRACTIONS]
        return min(live, key=lambda r: (len(r.output_ids), -r.prompt_len), default=None)

    def _retract(self, req: DecodeReq, retract: Callable[[DecodeReq], None]) -> None:
        self.retractions += 1
        self.reprefilled += len(req.output_ids)
        if self.metrics is not None:
            self.metrics.retractions.inc()
            self.metrics.reprefilled_tokens.inc(len(req.output_ids))
        retract(req)

    def _dry(self, req: DecodeReq, more: int) -> str:
        kv = self.books.kv
        return (
            f"the decode KV pool ({kv.size} slots, {kv.num_free} free) cannot give request {req.rid} {more} more "
            "slots and no running request is left to retract (--max-total-tokens, --decode-kv-grow-tokens)"
        )


def prefill_request(req: DecodeReq) -> HandoffRequest:
    """What prefill computes for `req`: its prompt, or for a retracted request prompt + the outputs sent
    so far, sampled at its next output position (alone: a retracted sample of n > 1 keeps its own seed;
    its prompt logprobs went out with its first output already)."""
    if not req.retractions:  # the KV of positions prefix_len.. (decode's prefix cache holds the rest)
        slots = req.kv_slots[req.prefix_len :]
        return HandoffRequest(
            req.rid, req.prompt_ids, req.params, req.seed, kv_slots=slots, trace=req.trace, kv_start=req.prefix_len
        )
    params = dataclasses.replace(req.params, n=1, logprob_start_len=-1)
    prompt, sent = req.prompt_ids + req.output_ids, len(req.output_ids)
    return HandoffRequest(req.rid, prompt, params, req.seed, sent, kv_slots=req.kv_slots, trace=req.trace)
