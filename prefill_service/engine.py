"""PrefillEngine: continuous chunked prefill across requests, one extend forward per step.

Lifecycle of a request:
  1. `admit` validates it against this model (non-empty, ids in the vocabulary, fits the context) and
     reserves a request slot and KV slots for its prompt (`can_admit` says whether they are free);
  2. each `step` runs one extend forward of at most `chunk_size` tokens over the running prompts
     (chunked_prefill.py's budget policy: short prompts first, the oldest never starves),
     continuing each from the KV already in the pool;
  3. in the step where its prompt completes: sample the first token (output position
     `first_position` of the request's seeded stream); with EAGLE on, the draft extend over the
     prompt (its features were kept during 2) gives the draft KV and the draft seed (draft_prefill.py);
  4. copy the prompt's K/V (and draft K/V) out of the pool into a Handoff, free its slots exactly
     once, and return the Handoff from that step, so its first token goes out while longer prompts
     are still computing;
  5. `abort` frees a running request's slots (its call was cancelled); `fail_all` frees every one.
`prefill(requests)` runs a list of requests to completion (tests, tools).
The prefill side is stateless between requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.chunked_prefill import plan_chunk, prefill_step
from common.engine.handoff import Handoff, HandoffRequest
from common.engine.model_runner import ModelRunner
from common.engine.sampling import sample
from common.request_rules import validate_prompt
from prefill_service.draft_prefill import draft_extend


@dataclass
class _Running:
    request: HandoffRequest
    req_pool_idx: int
    kv_slots: torch.Tensor
    prefilled: int = 0
    first_token: int | None = None
    prompt: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # EAGLE: target features, chunk by chunk


class PrefillEngine:
    def __init__(self, runner: ModelRunner, chunk_size: int = 256):
        self.runner = runner
        self.chunk_size = chunk_size
        self.running: list[_Running] = []  # admitted, prompt not complete yet (oldest first)

    # ---- admission ---------------------------------------------------------------------------------
    def validate(self, request: HandoffRequest) -> None:
        kv = self.runner.kv_allocator
        validate_prompt(
            request.prompt_ids,
            request.params,
            self.runner.config.vocab_size,
            self.runner.context_length,
            kv_capacity=kv.size,
        )

    def can_admit(self, request: HandoffRequest) -> bool:
        return self.runner.req_to_token_pool.allocator.num_free > 0 and self.runner.kv_allocator.can_alloc(
            len(request.prompt_ids)
        )

    def admit(self, request: HandoffRequest) -> None:
        self.validate(request)
        pool, kv = self.runner.req_to_token_pool, self.runner.kv_allocator
        row, slots = pool.alloc(), kv.alloc(len(request.prompt_ids))
        pool.write(row, 0, slots)
        self.running.append(_Running(request, row, slots, prompt=list(request.prompt_ids)))

    def abort(self, request: HandoffRequest) -> bool:
        """Free a running request's slots; False if it is not running."""
        for w in self.running:
            if w.request is request:
                self.running.remove(w)
                self._free(w)
                return True
        return False

    def fail_all(self) -> list[HandoffRequest]:
        """Free every running request (after a failed step); their requests."""
        failed = [w.request for w in self.running]
        for w in self.running:
            self._free(w)
        self.running = []
        return failed

    # ---- one step ----------------------------------------------------------------------------------
    def plan(self) -> list[tuple[_Running, int]]:
        """(request, tokens) of the next forward under the budget policy (common/engine/chunked_prefill.py)."""
        return plan_chunk(self.running, self.chunk_size)

    def step(self, on_first_token=None) -> list[tuple[HandoffRequest, Handoff]]:
        """One extend forward; (request, Handoff) of each prompt it completed (its slots already freed).
        `on_first_token(request, token)` hears each completed prompt's first token as soon as it is
        sampled, before its KV is copied out (and, with EAGLE, before the draft extend)."""
        spec = self.runner.draft is not None
        finished, logits = prefill_step(
            self.runner, self.running, self.chunk_size, self._keep_features if spec else None
        )
        if not finished:
            return []
        self._sample_first(finished, logits)
        if on_first_token is not None:
            for w in finished:
                on_first_token(w.request, w.first_token)
        handoffs = []
        for w in finished:
            self.running.remove(w)
            try:
                handoffs.append((w.request, self._to_handoff(w)))
            finally:
                self._free(w)
        return handoffs

    def prefill(self, requests: list[HandoffRequest]) -> list[Handoff]:
        """Run `requests` to completion (admitting as slots free up); Handoffs in request order."""
        for r in requests:
            self.validate(r)
        todo, out = list(requests), {}  # id(request) -> Handoff
        try:
            while todo or self.running:
                while todo and self.can_admit(todo[0]):
                    self.admit(todo.pop(0))
                if not self.running:
                    raise RuntimeError("a prompt does not fit the free KV slots")
                out.update((id(r), h) for r, h in self.step())
        except BaseException:
            self.fail_all()
            raise
        return [out[id(r)] for r in requests]

    # ---- helpers -----------------------------------------------------------------------------------
    def _free(self, w: _Running) -> None:
        self.runner.kv_allocator.free(w.kv_slots)
        self.runner.req_to_token_pool.free(w.req_pool_idx)

    def _sample_first(self, done: list[_Running], logits: torch.Tensor) -> None:
        tokens = sample(
            logits,
            [w.request.params for w in done],
            [w.request.seed for w in done],
            [w.request.first_position for w in done],
        )
        for w, t in zip(done, tokens.tolist()):
            w.first_token = t

    @staticmethod
    def _keep_features(chunk: list, features: torch.Tensor) -> None:
        start = 0
        for w, _, ids in chunk:
            w.features.append(features[start : start + len(ids)])
            start += len(ids)

    def _to_handoff(self, w: _Running) -> Handoff:
        pool = self.runner.kv_pool
        loc = w.kv_slots.to(pool.device)
        r = w.request
        extra = {}
        if self.runner.draft is not None:
            extra = draft_extend(
                self.runner,
                w.req_pool_idx,
                w.prompt,
                w.first_token,
                torch.cat(w.features),
                self.chunk_size,
                self.runner.draft.spec.eagle_topk,
            )
            w.features = []
            dpool = self.runner.draft.kv_pool
            extra.update(draft_k=[dpool.k[0][loc].cpu()], draft_v=[dpool.v[0][loc].cpu()])
        return Handoff(
            rid=r.rid,
            prompt_ids=list(r.prompt_ids),
            params=r.params,
            seed=r.seed,
            first_token=w.first_token,
            k=[k[loc].cpu() for k in pool.k],
            v=[v[loc].cpu() for v in pool.v],
            first_position=r.first_position,
            **extra,
        )
