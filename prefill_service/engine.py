"""PrefillEngine: batches prompts, runs chunked prefill, samples the first token, emits handoffs.

Lifecycle of `prefill(requests)`:
  1. validate each request against this model (non-empty, ids in the vocabulary, fits the context);
  2. take requests in order while a request slot and KV slots for the prompt are free (a wave);
  3. chunked prefill of the wave under the token budget (`chunk_size`);
  4. sample the first token (output position 0 of the request's seeded stream);
  5. with EAGLE on: the draft extend over each prompt (its features were kept during 3) gives the
     draft KV and the draft seed (draft_prefill.py);
  6. copy the prompt's K/V (and draft K/V) out of the pool into a Handoff, free the wave's slots
     exactly once;
  7. repeat until every request has its handoff.
The prefill side is stateless between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.chunked_prefill import run_chunked_prefill
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

    def prefill(self, requests: list[HandoffRequest]) -> list[Handoff]:
        cfg, kv = self.runner.config, self.runner.kv_allocator
        for r in requests:
            validate_prompt(r.prompt_ids, r.params, cfg.vocab_size, self.runner.context_length, kv_capacity=kv.size)
        handoffs: list[Handoff] = []
        todo = list(requests)
        while todo:
            wave = self._reserve_wave(todo)
            todo = todo[len(wave):]
            try:
                spec = self.runner.draft is not None
                run_chunked_prefill(self.runner, wave, self.chunk_size, self._sample_first,
                                    on_features=self._keep_features if spec else None)
                handoffs.extend(self._to_handoff(w) for w in wave)
            finally:
                for w in wave:
                    kv.free(w.kv_slots)
                    self.runner.req_to_token_pool.free(w.req_pool_idx)
        return handoffs

    def _reserve_wave(self, todo: list[HandoffRequest]) -> list[_Running]:
        pool, kv = self.runner.req_to_token_pool, self.runner.kv_allocator
        wave = []
        for r in todo:
            if pool.allocator.num_free == 0 or not kv.can_alloc(len(r.prompt_ids)):
                break
            row, slots = pool.alloc(), kv.alloc(len(r.prompt_ids))
            pool.write(row, 0, slots)
            wave.append(_Running(r, row, slots, prompt=list(r.prompt_ids)))
        return wave

    def _sample_first(self, done: list[_Running], logits: torch.Tensor) -> None:
        tokens = sample(logits, [w.request.params for w in done], [w.request.seed for w in done],
                        [w.request.first_position for w in done])
        for w, t in zip(done, tokens.tolist()):
            w.first_token = t

    @staticmethod
    def _keep_features(chunk: list, features: torch.Tensor) -> None:
        start = 0
        for w, _, ids in chunk:
            w.features.append(features[start:start + len(ids)])
            start += len(ids)

    def _to_handoff(self, w: _Running) -> Handoff:
        pool = self.runner.kv_pool
        loc = w.kv_slots.to(pool.device)
        r = w.request
        extra = {}
        if self.runner.draft is not None:
            extra = draft_extend(self.runner, w.req_pool_idx, w.prompt, w.first_token, torch.cat(w.features),
                                 self.chunk_size, self.runner.draft.spec.eagle_topk)
            w.features = []
            dpool = self.runner.draft.kv_pool
            extra.update(draft_k=[dpool.k[0][loc].cpu()], draft_v=[dpool.v[0][loc].cpu()])
        return Handoff(rid=r.rid, prompt_ids=list(r.prompt_ids), params=r.params, seed=r.seed,
                       first_token=w.first_token, k=[k[loc].cpu() for k in pool.k], v=[v[loc].cpu() for v in pool.v],
                       first_position=r.first_position, **extra)
