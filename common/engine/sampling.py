"""Sampling: SamplingParams and a batched sampler (greedy, temperature, top-k, top-p, min-p).

Randomness is counter-based: the uniform number that picks request r's token at output index n
is a hash of (seed_r, n). No generator state is carried, so a seeded request gives the same tokens
whatever batch it shares, on any device, and across the prefill -> decode handoff (prefill samples
output index 0, decode the rest). A token is chosen by inverse CDF over the (filtered) distribution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from common.engine.grammar import check_constraint, constraint_of
from common.engine.logprobs import MAX_TOKEN_IDS_LOGPROB, MAX_TOP_LOGPROBS, LogprobRows
from common.engine.penalties import MAX_LOGIT_BIAS, LogitProcessors, has_processors
from common.forward.host_copy import to_device

_MASK64 = (1 << 64) - 1
MAX_N = 128  # OpenAI's bound on n
MIN_TEMPERATURE = 1e-5  # below it a request is greedy (as SGLang): the softmax of logits / T would overflow


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = -1  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: a random seed is drawn once per request
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_new_tokens: int = 0  # until this many outputs, EOS and stop ids are masked (never sampled)
    repetition_penalty: float = 1.0  # HF semantics: prompt and output ids (common/engine/penalties.py)
    frequency_penalty: float = 0.0  # OpenAI semantics: output ids only
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    return_logprob: bool = False  # output logprobs of the raw logits (common/engine/logprobs.py)
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = field(default_factory=tuple)
    # prompt logprobs (with return_logprob) of prompt positions logprob_start_len.. (-1: none; 0: from the
    # first token, which has none): computed on prefill (common/engine/prompt_logprobs.py)
    logprob_start_len: int = -1
    stop_strings: tuple[str, ...] = field(default_factory=tuple)  # matched in the decoded text (decode side)
    # at most one constraint: the mask of common/engine/grammar.py (after penalties and bias)
    json_schema: str | None = None
    regex: str | None = None
    ebnf_grammar: str | None = None
    structural_tag: str | None = None
    n: int = 1  # samples of one prompt (OpenAI's n): prefill runs it once; sample i draws with sample_seed(seed, i)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the bad field."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_new_tokens < 0:  # (above max_new_tokens: refused by the front door, which knows the budget)
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("frequency_penalty", "presence_penalty"):  # OpenAI's ranges
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        bad_bias = [b for b in self.logit_bias.values() if not -100 <= b <= 100]
        if bad_bias:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bad_bias[:4]}")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}")
        if len(self.token_ids_logprob) > MAX_TOKEN_IDS_LOGPROB:
            raise ValueError(f"token_ids_logprob has more than {MAX_TOKEN_IDS_LOGPROB} ids")
        if self.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 (none) or >= 0, got {self.logprob_start_len}")
        check_constraint(self)  # GrammarError is a ValueError naming the field
        if vocab_size is not None:
            bad = [t for t in self.token_ids_logprob if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token_ids_logprob outside the vocabulary [0, {vocab_size}): {bad[:8]}")
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad}")
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")

    @property
    def prompt_logprobs(self) -> bool:
        """The request asks for the logprobs of its prompt from position logprob_start_len."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below MIN_TEMPERATURE: the argmax (logits / 1e-45 overflow float32)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def processed(self) -> bool:
        """A penalty or a logit bias changes the logits before sampling (common/engine/penalties.py)."""
        return has_processors(self)

    @property
    def argmax_only(self) -> bool:
        """Every token is the argmax of the raw logits, and nothing else of them is needed: greedy, with
        no min_new_tokens mask, no penalty, no logit bias and no logprobs."""
        return (
            self.greedy
            and not self.min_new_tokens
            and not self.processed
            and not self.return_logprob
            and self.constraint is None
        )

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field, text) of the request's grammar constraint, or None (common/engine/grammar.py)."""
        return constraint_of(self)

    @property
    def filtered(self) -> bool:
        """top-k, top-p or min-p narrows the distribution (sampling must sort)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def resolved_seed(self) -> int:
        """The seed to use; call once per request and keep it (None draws a fresh one)."""
        return self.seed if self.seed is not None else random.getrandbits(63)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of an n > 1 request whose resolved seed is `seed`: sample i draws
    exactly as an n = 1 request with this seed would (sample 0 keeps `seed`)."""
    return (seed + index) % (1 << 63)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, output_index: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, output index)."""
    return (_splitmix64(_splitmix64(seed) ^ output_index) >> 11) * (1.0 / (1 << 53))


def keep_sorted(
    sorted_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Which candidates of each row of probabilities sorted descending [N, V] survive top-k, top-p and
    min-p (params [N, 1]); the most likely one always does."""
    rank = torch.arange(sorted_probs.shape[1], device=sorted_probs.device)[None, :]
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly ahead of each candidate
    keep = (rank < top_k) & (before < top_p) & (sorted_probs >= min_p * sorted_probs[:, :1])
    keep[:, 0] = True
    return keep


def sorted_candidates(probs: torch.Tensor, width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities sorted descending, their ids) of each row of probs [N, V]: only the `width`
    largest (torch.topk, no sort of the vocabulary) when no row keeps more (every row has a top-k of
    at most `width`); otherwise the whole vocabulary, stably sorted."""
    if width is None or width >= probs.shape[1]:
        return torch.sort(probs, dim=-1, descending=True, stable=True)
    return torch.topk(probs, width, dim=-1, sorted=True)


def topk_width(params) -> int | None:
    """The most candidates any of these rows keeps under its top-k, or None when one has no top-k."""
    return max(p.top_k for p in params) if params and all(p.top_k > 0 for p in params) else None


class SamplingBatch:
    """A batch's sampling inputs, built once when the batch's membership changes (the decode
    scheduler keeps one per ScheduleBatch), not every step: which rows are greedy, temperature-only
    or filtered, and their parameters as device tensors (made on first use)."""

    def __init__(self, params: list[SamplingParams], seeds: list[int]):
        self.params, self.seeds = list(params), list(seeds)
        self.plain = [i for i, p in enumerate(self.params) if not p.greedy and not p.filtered]
        self.filtered = [i for i, p in enumerate(self.params) if not p.greedy and p.filtered]
        self.holds_back = any(p.min_new_tokens for p in self.params)  # then sample() needs every row's output index
        self.constrained = [i for i, p in enumerate(self.params) if p.constraint is not None]  # grammar rows
        self._tensors: dict = {}

    def processors(self, device: torch.device) -> LogitProcessors | None:
        """The rows with a penalty or a logit bias and their parameters on `device` (made once), or None."""
        key = ("processors", device)
        if key not in self._tensors:
            self._tensors[key] = LogitProcessors.build(self.params, device)
        return self._tensors[key]

    def logprob_rows(self, device: torch.device) -> LogprobRows | None:
        """The rows that ask for logprobs and what they ask, on `device` (made once), or None."""
        key = ("logprobs", device)
        if key not in self._tensors:
            self._tensors[key] = LogprobRows.build(self.params, device)
        return self._tensors[key]

    @property
    def all_greedy(self) -> bool:
        return not self.plain and not self.filtered

    @property
    def argmax_only(self) -> bool:
        """Every row's token is its logits' argmax (SamplingParams.argmax_only for all of them)."""
        return all(p.argmax_only for p in self.params)

    def sample(
        self, logits: torch.Tensor, output_indices: list[int], eos_token_ids: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """logits [B, V] (float32) -> token ids [B] (int64, same device); `output_indices`: the output
        index of each row's token (which uniform it draws, whether min_new_tokens holds it back).
        Greedy rows take the argmax. Temperature-only rows draw by inverse CDF over the vocabulary in
        id order (no sort: O(V)); rows with top-k / top-p / min-p sort once (only the top-k candidates
        when every such row has a top-k).
        Rows below their min_new_tokens never get EOS (`eos_token_ids`, the model's) or a stop id (as
        HF's MinNewTokensLengthLogitsProcessor does for EOS)."""
        logits = self.hold_back_stops(logits, output_indices, eos_token_ids)
        from common.models import cpu_fused  # model code, imported where a forward ran (the scheduler imports none)

        tokens = cpu_fused.argmax(logits)
        for rows, filters in ((self.plain, False), (self.filtered, True)):
            if rows:
                self._draw(logits, tokens, rows, output_indices, filters)
        return tokens

    def hold_back_stops(self, logits: torch.Tensor, output_indices: list[int], eos_token_ids=()) -> torch.Tensor:
        """logits with -inf at EOS and stop ids for rows whose output index is below their
        min_new_tokens (a copy; the input is returned as it is when no row is)."""
        if not self.holds_back:
            return logits
        rows = [i for i, p in enumerate(self.params) if output_indices[i] < p.min_new_tokens]
        if not rows:
            return logits
        banned = [sorted(set(eos_token_ids) | set(self.params[i].stop_token_ids)) for i in rows]
        width = max(1, max(len(b) for b in banned))
        ids = to_device([b + [0] * (width - len(b)) for b in banned], logits.device)
        valid = to_device([[j < len(b) for j in range(width)] for b in banned], logits.device, torch.bool)
        idx = to_device(rows, logits.device)
        sub = logits[idx]
        sub.scatter_(1, ids, torch.where(valid, float("-inf"), sub.gather(1, ids)))
        return logits.index_copy(0, idx, sub)

    def hold_back_stops_at(self, logits: torch.Tensor, first: list[int], offsets: torch.Tensor, eos_token_ids=()):
        """The same mask for EAGLE's verify: logits [B, M, V], where row b's node m samples output
        position first[b] + offsets[b, m] (offsets on the device: a tree's depths), so nothing here
        waits for the device. A copy; the input as it is when no row has a min_new_tokens."""
        if not self.holds_back:
            return logits
        device = logits.device
        banned = [sorted(set(eos_token_ids) | set(p.stop_token_ids)) for p in self.params]
        width = max(1, max(len(b) for b in banned))
        ids = to_device([b + [0] * (width - len(b)) for b in banned], device)  # [B, K]
        valid = to_device([[j < len(b) for j in range(width)] for b in banned], device, torch.bool)
        room = to_device([p.min_new_tokens - f for p, f in zip(self.params, first)], device)  # [B]
        active = offsets < room[:, None]  # [B, M]: this node's position is below the minimum
        idx = ids[:, None, :].expand(-1, logits.shape[1], -1)  # [B, M, K]
        hide = active[:, :, None] & valid[:, None, :]
        out = logits.clone()
        out.scatter_(2, idx, torch.where(hide, float("-inf"), out.gather(2, idx)))
        return out

    def _row_tensors(self, rows: list[int], filters: bool, device: torch.device):
        key = (filters, device)
        if key not in self._tensors:
            ps = [self.params[i] for i in rows]
            self._tensors[key] = (
                to_device(rows, device),
                to_device([[p.temperature] for p in ps], device),
                to_device([[p.top_k if p.top_k > 0 else 1 << 62] for p in ps], device),
                to_device([[p.top_p] for p in ps], device),
                to_device([[p.min_p] for p in ps], device),
                topk_width(ps),
            )
        return self._tensors[key]

    def _draw(self, logits, tokens, rows, output_indices, filters: bool) -> None:
        idx, temperature, top_k, top_p, min_p, width = self._row_tensors(rows, filters, logits.device)
        sub = logits[idx].float()
        probs = torch.softmax(sub / temperature, dim=-1)
        u = to_device([uniform(self.seeds[i], output_indices[i]) for i in rows], logits.device, probs.dtype)
        last = sub.shape[1] - 1
        if not filters:
            cdf = torch.cumsum(probs, dim=-1)
            tokens[idx] = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=last).squeeze(1)
            return
        sorted_probs, order = sorted_candidates(probs, width)
        keep = keep_sorted(sorted_probs, top_k, top_p, min_p)
        cdf = torch.cumsum(torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs)), dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=sorted_probs.shape[1] - 1)
        pick = torch.minimum(pick, keep.sum(-1, keepdim=True) - 1)  # float edge: stay inside the kept set
        tokens[idx] = order.gather(1, pick).squeeze(1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    output_indices: list[int],
    eos_token_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """One-off sampling of a batch (see SamplingBatch.sample)."""
    return SamplingBatch(params, seeds).sample(logits, output_indices, eos_token_ids)
