"""ColocatedLoop: the reference serving loop, prefill and decode in one process, synchronously (no
scheduler, no handoff); the tests' reference for the pair and the EAGLE fitting tool's generator.

Lifecycle of `generate(prompts, params)`:
  1. validate every request (non-empty prompt, ids in the vocabulary, prompt + max_new_tokens
     within the context) before anything is allocated;
  2. reserve a request slot and KV slots for prompt + max_new_tokens per request (all or nothing)
     and map them in the ReqToTokenPool rows;
  3. chunked prefill: extend batches of at most `chunk_size` tokens, continuing prompts from the KV
     already in the pool; a request whose prompt completes samples its first token;
  4. decode: one token per running request per step until EOS / stop_token_ids / max_new_tokens;
  5. free every slot exactly once (also when a step raises).
With `capture` (the fitting tool's data), each request also keeps the draft head's input features of
every position that ran (prompt + output[:-1]): the final normed hidden, or those layers (EAGLE3).
The disaggregated services reuse the same pieces (ForwardBatch, ModelRunner, sampler, request rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.chunked_prefill import run_chunked_prefill
from common.engine.model_runner import ModelRunner
from common.engine.penalties import LogitProcessors, state_from_ids
from common.engine.sampling import SamplingParams, sample
from common.forward.forward_batch import ForwardBatch
from common.request_rules import finish_reason, validate_prompt


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    seed: int
    req_pool_idx: int = 0
    kv_slots: torch.Tensor | None = None
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    features: list[torch.Tensor] = field(default_factory=list)  # with ColocatedLoop(capture=...)

    @property
    def kv_committed_len(self) -> int:
        """Tokens whose KV is in the pool (the last sampled token is not yet run)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)


class ColocatedLoop:
    def __init__(self, runner: ModelRunner, chunk_size: int = 256, capture: tuple[int, ...] | None = None):
        self.runner = runner
        self.chunk_size = chunk_size
        self.capture = capture
        self.eos_ids = runner.config.eos_token_ids

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        for p, sp in zip(prompts, params):
            validate_prompt(p, sp, self.runner.config.vocab_size, self.runner.context_length)
            if sp.constraint is not None:  # never silently unconstrained
                raise ValueError(f"{sp.constraint[0]}: grammars are served by the decode pair, not this reference loop")
            if sp.prompt_logprobs:  # never silently without them
                raise ValueError("logprob_start_len: prompt logprobs are served by the pair, not this reference loop")
        reqs = [Request(list(p), sp, sp.resolved_seed()) for p, sp in zip(prompts, params)]
        self._reserve(reqs)
        try:
            self._prefill(reqs)
            self._decode([r for r in reqs if r.finish_reason is None])
        finally:
            self._release(reqs)
        return reqs

    def _reserve(self, reqs: list[Request]) -> None:
        pool, kv = self.runner.req_to_token_pool, self.runner.kv_allocator
        need = sum(len(r.prompt) + r.params.max_new_tokens for r in reqs)
        if len(reqs) > pool.allocator.num_free or not kv.can_alloc(need):
            raise RuntimeError(
                f"batch does not fit: {len(reqs)} requests / {need} KV slots, "
                f"{pool.allocator.num_free} request slots / {kv.num_free} KV slots free"
            )
        for r in reqs:
            r.req_pool_idx = pool.alloc()
            r.kv_slots = kv.alloc(len(r.prompt) + r.params.max_new_tokens)
            pool.write(r.req_pool_idx, 0, r.kv_slots)

    def _release(self, reqs: list[Request]) -> None:
        for r in reqs:
            if r.kv_slots is not None:
                self.runner.kv_allocator.free(r.kv_slots)
                r.kv_slots = None
            if r.req_pool_idx:
                self.runner.req_to_token_pool.free(r.req_pool_idx)
                r.req_pool_idx = 0

    def _sample_into(self, reqs: list[Request], logits: torch.Tensor) -> None:
        procs = LogitProcessors.build([r.params for r in reqs], logits.device)
        if procs is not None:  # penalties and bias from the ids, known here on the host
            done = [reqs[i] for i in procs.rows_cpu]
            state = state_from_ids([r.prompt for r in done], [r.output for r in done], logits.shape[-1], logits.device)
            logits = procs.apply(logits, *state)
        tokens = sample(logits, [r.params for r in reqs], [r.seed for r in reqs], [len(r.output) for r in reqs])
        for r, t in zip(reqs, tokens.tolist()):
            r.output.append(t)
            r.finish_reason = finish_reason(r.params, r.output, self.eos_ids)

    def _prefill(self, reqs: list[Request]) -> None:
        run_chunked_prefill(
            self.runner,
            reqs,
            self.chunk_size,
            self._sample_into,
            None if self.capture is None else self._keep_prefill_features,
            self.capture,
        )

    def _keep_prefill_features(self, chunk: list, features: torch.Tensor) -> None:
        start = 0
        for r, _, ids in chunk:
            r.features.append(features[start : start + len(ids)].float().cpu())
            start += len(ids)

    def _decode(self, running: list[Request]) -> None:
        table = self.runner.req_to_token_pool.req_to_token
        while running:
            rows = [r.req_pool_idx for r in running]
            batch = ForwardBatch.decode(
                table,
                torch.tensor(rows),
                [r.kv_committed_len for r in running],
                torch.tensor([r.output[-1] for r in running]),
                req_pool_indices_cpu=rows,
            )
            if self.capture is None:
                logits, _ = self.runner.forward(batch)
            else:
                logits, features = self.runner.forward_features(batch, self.capture)
                for r, f in zip(running, features.float().cpu()):
                    r.features.append(f[None])
            self._sample_into(running, logits)
            running = [r for r in running if r.finish_reason is None]
