"""PrefillWorker: the model-running part of prefill (decode's DecodeWorker, SGLang's TpModelWorker):
continuous chunked prefill across requests, one extend forward per step.

Lifecycle of a request:
  1. `admit` validates it against this model (non-empty, ids in the vocabulary, fits the context),
     takes the KV of its longest cached prefix from the radix cache (radix_cache.py; locked while it
     runs; at most all but the last prompt token; with EAGLE only positions whose head KV was made
     with this prompt's next token; with prompt logprobs only positions below logprob_start_len - 1,
     whose logits it does not report), and reserves a request slot and KV slots for the rest (with
     EAGLE and n > 1, n - 1 more: the samples' scratch for their head KV at the last position), evicting
     unlocked cached prefixes when the pool is short (`can_admit` says whether that is possible);
  2. each `step` runs one extend forward of at most `chunk_size` tokens over the running prompts
     (chunked_prefill.py's budget policy: short prompts first, the oldest never starves),
     continuing each from the KV already in the pool; a request that asks for prompt logprobs gets
     the logits of its chunk's positions too (common/engine/prompt_logprobs.py, kept on the device);
  3. in the step where its prompt completes: sample the first token (output position
     `first_position` of the request's seeded stream; with n > 1, n draws from the same processed
     logits, draw i seeded with sample_seed(seed, i): `_more_samples`); with EAGLE on, the draft
     extend over the prompt (its features were kept during 2) gives the draft KV and the draft seed
     (draft_prefill.py; of sample 0's first token; with n > 1 one more head forward gives samples
     1..n-1 their own seeds and head KV at the last position);
  4. copy the prompt's K/V (and draft K/V) out of the pool into a Handoff (cached part included, and
     the prompt logprobs when asked, copied to the host), in
     the memory the KV transport stages it in (`staging`: the host, or the pool's device for a
     transport that reads device memory; then without waiting for the device: `StagedHandoff.kv_ready`),
     insert the prompt into the radix cache (its own slots that duplicate cached ones are freed),
     unlock its prefix and free its request slot, exactly once, and return the Handoff from that
     step, so its first token goes out while longer prompts are still computing;
  5. `abort` frees a running request's own slots and unlocks its prefix (its call was cancelled);
     `fail_all` does that for every one.
`prefill(requests)` runs a list of requests to completion (tests, tools). Between requests the
worker keeps only the radix cache (`radix_cache=False`: nothing, every prompt computed in full).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.chunked_prefill import plan_chunk, prefill_step
from common.engine.grammar import mask_first_tokens
from common.engine.handoff import HandoffRequest
from common.engine.logprobs import first_token_logprobs
from common.engine.model_runner import ModelRunner
from common.engine.penalties import LogitProcessors, state_from_ids
from common.engine.prompt_logprobs import PromptParts, PromptRows, cacheable_prefix
from common.engine.radix_cache import CacheStats, RadixCache
from common.engine.sampling import sample, sample_seed
from common.forward.host_copy import to_device
from common.kv_transfer.staging import StagedHandoff, copied_out
from common.parallel.tp_shard import gather_kv_heads
from common.request_rules import InvalidRequest, validate_prompt
from prefill_service.draft_prefill import draft_extend, sample_drafts


@dataclass
class _Running:
    request: HandoffRequest
    req_pool_idx: int
    kv_slots: torch.Tensor
    prefilled: int = 0
    first_token: int | None = None
    first_logprobs: object = None  # TokenLogprobs, when the request asks for logprobs
    more_tokens: tuple[int, ...] = ()  # n > 1: the first tokens of samples 1..n-1
    more_logprobs: tuple = ()  # n > 1: their TokenLogprobs, when the request asks for logprobs
    prompt: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # EAGLE: target features, chunk by chunk
    cached: int = 0  # leading prompt tokens whose KV came from the radix cache (kv_slots[:cached] are the tree's)
    node: object = None  # the radix node locked for those (None without the cache)
    prompt_parts: PromptParts | None = None  # its prompt logprobs so far, when it asks for them
    scratch: torch.Tensor | None = None  # EAGLE, n > 1: n - 1 KV slots for the samples' heads (draft_prefill.py)


class PrefillWorker:
    def __init__(
        self,
        runner: ModelRunner,
        chunk_size: int = 256,
        radix_cache: bool = True,
        staging: torch.device | str = "cpu",
    ):
        """`staging`: where handoffs' KV is copied out to (the KV sender's `staging_device`)."""
        self.runner = runner
        self.chunk_size = chunk_size
        self.staging = torch.device(staging)
        self.running: list[_Running] = []  # admitted, prompt not complete yet (oldest first)
        self.cache = RadixCache(runner.kv_allocator.free) if radix_cache else None
        self.stats = CacheStats()

    @property
    def request_kv_used(self) -> int:
        """KV slots held by running requests (what is used minus what the cache holds): 0 when idle."""
        return self.runner.kv_allocator.num_used - (self.cache.tree_size if self.cache else 0)

    def check_idle_integrity(self) -> None:
        """Idle: every used KV slot is the cache's, each once; every request slot is free."""
        tree = [torch.tensor(self.cache.all_slots(), dtype=torch.int64)] if self.cache else []
        self.runner.kv_allocator.check_integrity(holders=tree)
        self.runner.req_to_token_pool.allocator.check_integrity(holders=[])
        assert self.cache is None or self.cache.locked_size == 0, "a finished request left its prefix locked"

    # ---- admission ---------------------------------------------------------------------------------
    def validate(self, request: HandoffRequest) -> None:
        """InvalidRequest (a ValueError) unless this replica can prefill the request: the prompt and
        params against the model and pool, the resent outputs within the prompt (the one check of a
        request here: PrefillScheduler.submit, for the server and in-process callers alike)."""
        prompt, params = request.prompt_ids, request.params
        validate_prompt(
            prompt,
            params,
            self.runner.config.vocab_size,
            self.runner.context_length,
            kv_capacity=self.runner.kv_allocator.size,
        )
        if request.first_position >= len(prompt):
            raise InvalidRequest("first_output_position must be < len(input_ids)")
        if request.kv_start >= len(prompt):
            raise InvalidRequest("kv_start must be < len(input_ids): the handoff carries one position at least")
        if params.prompt_logprobs and params.logprob_start_len >= len(prompt) - request.first_position:
            raise InvalidRequest(
                "logprob_start_len must be below the prompt's length (input_ids less the resent outputs)"
            )

    def _reusable(self, request: HandoffRequest) -> tuple[torch.Tensor, object]:
        """(cached slots this prompt may reuse, the node to lock) - see step 1."""
        if self.cache is None:
            return torch.empty(0, dtype=torch.int64), None
        prompt = request.prompt_ids
        slots, node, draft_ok = self.cache.match_prefix(prompt)
        # the last prompt token is always computed (its logits give the first token); with EAGLE only
        # positions whose head KV was made with this prompt's next token (radix_cache.Node.draft_next);
        # with prompt logprobs none whose logits it reports (prompt_logprobs.cacheable_prefix)
        keep = min(draft_ok if self.runner.draft is not None else len(slots), len(prompt) - 1)
        bound = cacheable_prefix(request.params)
        keep = keep if bound is None else min(keep, bound)
        return slots[: max(keep, 0)], node

    def can_admit(self, request: HandoffRequest) -> bool:
        if self.runner.req_to_token_pool.allocator.num_free == 0:
            return False
        cached, node = self._reusable(request)
        need = len(request.prompt_ids) - len(cached) + self._scratch_len(request)
        if self.cache is None:
            return self.runner.kv_allocator.can_alloc(need)
        self.cache.lock(node)  # what it would reuse does not count as evictable
        try:
            return self.runner.kv_allocator.num_free + self.cache.evictable_size >= need
        finally:
            self.cache.unlock(node)

    def admit(self, request: HandoffRequest) -> None:
        """Reserve a request slot and the KV slots of its prompt (the scheduler checked it at submit)."""
        pool, kv = self.runner.req_to_token_pool, self.runner.kv_allocator
        prompt = list(request.prompt_ids)
        cached, node = self._reusable(request)
        scratch = self._scratch_len(request)
        need = len(prompt) - len(cached) + scratch
        if self.cache is not None:
            self.cache.lock(node)
            if kv.num_free < need:
                self.cache.evict(need - kv.num_free)
        own = None
        try:
            own = kv.alloc(need)
            row = pool.alloc()
        except BaseException:  # nothing held on a refusal: slots back, prefix unlocked
            if own is not None:
                kv.free(own)
            if self.cache is not None:
                self.cache.unlock(node)
            raise
        slots = torch.cat([cached, own[: need - scratch]])
        pool.write(row, 0, slots)
        w = _Running(request, row, slots, prefilled=len(cached), prompt=prompt, cached=len(cached), node=node)
        w.scratch = own[need - scratch :]
        if request.params.prompt_logprobs:
            w.prompt_parts = PromptParts(request.params, len(prompt), request.first_position)
        self.running.append(w)
        self.stats.count(len(prompt), len(cached))

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

    def step(self, on_first_token=None) -> list[tuple[HandoffRequest, StagedHandoff]]:
        """One extend forward; (request, StagedHandoff) of each prompt it completed (its slots already freed).
        `on_first_token(request, token)` hears each completed prompt's first token as soon as it is
        sampled, before its KV is copied out (and, with EAGLE, before the draft extend)."""
        spec = self.runner.draft is not None
        greedy = all(w.request.params.argmax_only for w in self.running)
        asking = any(w.prompt_parts is not None for w in self.running)  # never with greedy (return_logprob)
        finished, logits = prefill_step(  # greedy: the first tokens themselves (the greedy head's, on CPU)
            self.runner,
            self.running,
            self.chunk_size,
            self._keep_features if spec else None,
            greedy=greedy,
            prompt_rows=self._prompt_rows if asking else None,
        )
        if not finished:
            return []
        self._sample_first(finished, logits, greedy)
        if on_first_token is not None:
            for w in finished:
                on_first_token(w.request, w.first_token)
        kv = self._copy_out(finished)  # still running: a failure here is fail_all's to free
        handoffs = []
        for w, (k, v) in zip(finished, kv):
            self.running.remove(w)
            try:
                handoffs.append((w.request, self._to_handoff(w, k, v)))
            except BaseException:
                self._free(w)
                raise
            self._retire(w)
        return handoffs

    def prefill(self, requests: list[HandoffRequest]) -> list[StagedHandoff]:
        """Run `requests` to completion (admitting as slots free up); Handoffs in request order."""
        for r in requests:
            self.validate(r)
        todo, out = list(requests), {}  # id(request) -> StagedHandoff
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
        """An aborted or failed request: its own slots back, its prefix unlocked."""
        self.runner.kv_allocator.free(w.kv_slots[w.cached :])
        self._release(w)

    def _retire(self, w: _Running) -> None:
        """A finished request: its prompt into the cache (own slots that duplicate cached ones freed)."""
        if self.cache is None:
            self._free(w)
            return
        present = self.cache.insert(w.prompt, w.kv_slots, draft_next=w.first_token)
        if present > w.cached:
            self.runner.kv_allocator.free(w.kv_slots[w.cached : present])
        self._release(w)

    def _scratch_len(self, request: HandoffRequest) -> int:
        return request.params.n - 1 if self.runner.draft is not None else 0

    def _release(self, w: _Running) -> None:
        if w.scratch is not None:
            self.runner.kv_allocator.free(w.scratch)
        if self.cache is not None:
            self.cache.unlock(w.node)
        self.runner.req_to_token_pool.free(w.req_pool_idx)

    def _sample_first(self, done: list[_Running], logits: torch.Tensor, greedy: bool) -> None:
        """The first token of each request (and, when n > 1, of its samples 1..n-1): `logits` are
        already the argmax tokens when `greedy`."""
        params = [w.request.params for w in done]
        forks = [i for i, p in enumerate(params) if p.n > 1]  # nothing more to do for n == 1 rows
        if greedy:
            tokens = logits
        else:
            raw, seeds = logits, [w.request.seed for w in done]
            positions = [w.request.first_position for w in done]
            procs = LogitProcessors.build(params, logits.device)
            if procs is not None:  # penalties and bias from the ids (a retry's resent outputs count as output)
                reqs = [done[i].request for i in procs.rows_cpu]
                splits = [len(r.prompt_ids) - r.first_position for r in reqs]
                prompts = [r.prompt_ids[:n] for r, n in zip(reqs, splits)]
                outputs = [r.prompt_ids[n:] for r, n in zip(reqs, splits)]
                vocab = logits.shape[-1]
                logits = procs.apply(logits, *state_from_ids(prompts, outputs, vocab, logits.device))
            lanes = [i for i, p in enumerate(params) if p.constraint is not None]
            if lanes:  # the grammar's mask, after penalties and bias (common/engine/grammar.py)
                logits = mask_first_tokens(self.runner, [done[i].request for i in lanes], lanes, logits)
            eos = self.runner.config.eos_token_ids
            tokens = sample(logits, params, seeds, positions, eos)
            for w, lp in zip(done, first_token_logprobs(raw, tokens, params)):  # of the raw logits
                w.first_logprobs = lp
            if forks:
                _more_samples([done[i] for i in forks], to_device(forks, logits.device), raw, logits, eos)
        for w, t in zip(done, tokens.tolist()):
            w.first_token = t
        if greedy:  # every draw of an argmax-only request is its argmax
            for i in forks:
                done[i].more_tokens = (done[i].first_token,) * (params[i].n - 1)

    @staticmethod
    def _prompt_rows(chunk: list) -> PromptRows | None:
        return PromptRows.plan(chunk, lambda w: w.prompt_parts)

    @staticmethod
    def _keep_features(chunk: list, features: torch.Tensor) -> None:
        start = 0
        for w, _, ids in chunk:
            w.features.append(features[start : start + len(ids)])
            start += len(ids)

    def _copy_out(self, done: list[_Running]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """The target KV of each completed prompt per layer [kv_len, kv_heads, head_dim] (positions kv_start..) on the
        staging device, gathered for the whole step in a few copies (`KVPool.gather_many`; one per
        request took 0.33 s for 63 prompts finishing together, on cores shared with decode). Staged
        on the pool's own device it stays the gather's copy: nothing waits for the device here."""
        tp, cfg, to = self.runner.tp, self.runner.config, self.staging

        def staged(x: torch.Tensor) -> list[torch.Tensor]:  # TP: every rank's heads, gathered on device
            return [t.to(to) for t in gather_kv_heads(tp, cfg, list(x.unbind(0)))] if tp.size > 1 else list(x.to(to))

        gathered = self.runner.kv_pool.gather_many([w.kv_slots[w.request.kv_start :] for w in done])
        return [(staged(k), staged(v)) for k, v in gathered]

    def _to_handoff(self, w: _Running, k: list[torch.Tensor], v: list[torch.Tensor]) -> StagedHandoff:
        r = w.request
        extra = {}
        if self.runner.draft is not None:
            row, topk, features = w.req_pool_idx, self.runner.draft.spec.eagle_topk, torch.cat(w.features)
            extra = draft_extend(self.runner, row, w.prompt, w.cached, w.first_token, features, self.chunk_size, topk)
            more = (row, len(w.prompt), w.first_token, w.more_tokens, features[-1:], w.scratch, extra, topk)
            extra.update(sample_drafts(self.runner, *more))  # n > 1: samples 1..n-1's own at the last position
            w.features = []
            sent = to_device(w.kv_slots[r.kv_start :], self.runner.draft.kv_pool.device)  # as the target's
            draft_k, draft_v = self.runner.draft.kv_pool.gather(sent)
            extra.update(draft_k=[draft_k[0].to(self.staging)], draft_v=[draft_v[0].to(self.staging)])
        return StagedHandoff(
            rid=r.rid,
            prompt_ids=list(r.prompt_ids),
            params=r.params,
            seed=r.seed,
            first_token=w.first_token,
            k=k,
            v=v,
            first_position=r.first_position,
            cached_tokens=w.cached,
            first_logprobs=w.first_logprobs,
            more_first_tokens=w.more_tokens,
            more_first_logprobs=w.more_logprobs,
            prompt_logprobs=w.prompt_parts.to_host() if w.prompt_parts is not None else None,
            kv_ready=copied_out(self.staging),
            kv_start=r.kv_start,
            **extra,
        )


def _more_samples(forks: list[_Running], rows: torch.Tensor, raw, logits, eos_token_ids) -> None:
    """Samples 1..n-1 of each request of `forks` (whose rows of `logits`, penalised, biased and masked
    as for sample 0, are `rows`): draw i at the same output position with sample_seed(seed, i), so it
    is what an n = 1 request with that seed would draw; its logprobs of the `raw` logits."""
    draws = [(w, i) for w in forks for i in range(1, w.request.params.n)]
    params = [w.request.params for w, _ in draws]
    seeds = [sample_seed(w.request.seed, i) for w, i in draws]
    positions = [w.request.first_position for w, _ in draws]
    idx = rows.repeat_interleave(to_device([w.request.params.n - 1 for w in forks], rows.device))
    tokens = sample(logits[idx], params, seeds, positions, eos_token_ids)
    logprobs = first_token_logprobs(raw[idx], tokens, params)
    tokens = tokens.tolist()
    start = 0
    for w in forks:
        end = start + w.request.params.n - 1
        w.more_tokens = tuple(tokens[start:end])
        w.more_logprobs = tuple(logprobs[start:end]) if w.request.params.return_logprob else ()
        start = end
