"""Prompt logprobs (SamplingParams.logprob_start_len = s >= 0, with return_logprob): for each prompt
position j in [s, L) the log-softmax of the raw logits at position j - 1, read at prompt[j], with the
top `top_logprobs_num` candidates and the request's `token_ids_logprob` (as the output logprobs,
common/engine/logprobs.py). Position 0 has no logprob (nothing precedes it): s = 0 reports it
without a value, as SGLang does. L is the original prompt's length: a retry's resent outputs
(HandoffRequest.first_position) are not prompt.

Computed on prefill during its extend forwards (chunked_prefill.prefill_step): a forward's
`logits_indices` gain, after the usual last row of each request, the rows of the asking requests'
positions j - 1 that the chunk covers, so a request that does not ask costs nothing and one that
asks costs one lm_head row per reported position; the values stay on the device chunk by chunk
(`PromptParts`) and reach the host once, with the request's handoff (`PromptParts.to_host`). The
positions whose logits are needed must be computed: the prefix cache gives such a request only the
KV of positions below max(s, 1) - 1 (prefill_service/worker.py).
"""

from __future__ import annotations

import torch

from common.engine.logprobs import LogprobRows, StepLogprobs, TokenLogprobs
from common.forward.host_copy import to_device


def logit_positions(params, prompt_len: int, first_position: int = 0) -> range:
    """The positions of a prompt whose logits give its prompt logprobs (position p gives prompt[p + 1]'s);
    empty when it does not ask. `prompt_len` counts a retry's resent outputs (`first_position` of them)."""
    if not params.prompt_logprobs:
        return range(0)
    return range(max(params.logprob_start_len, 1) - 1, prompt_len - first_position - 1)


def cacheable_prefix(params) -> int | None:
    """How many leading positions of a prompt may come from the prefix cache (no logits there): None
    when the request does not ask for prompt logprobs (no bound)."""
    return max(params.logprob_start_len, 1) - 1 if params.prompt_logprobs else None


class PromptParts:
    """One request's prompt logprobs so far: device tensors per forward, in position order."""

    def __init__(self, params, prompt_len: int, first_position: int = 0):
        self.params = params
        self.positions = logit_positions(params, prompt_len, first_position)
        self.parts: list[tuple[torch.Tensor, ...]] = []  # (token [R], top vals [R, K], top ids [R, K], ids [R, J])

    def to_host(self) -> tuple[TokenLogprobs, ...]:
        """Every position's TokenLogprobs (one blocking copy: prefill reads its first tokens here too)."""
        if not self.parts:
            return ()
        token, vals, ids_, asked = (torch.cat(t).cpu() for t in zip(*self.parts))
        step = StepLogprobs([], token[:, None], vals[:, None], ids_[:, None], asked[:, None])
        return tuple(step.at(i, 0, self.params) for i in range(len(token)))


class PromptRows:
    """The extra logits rows of one extend forward: for each asking request of the chunk, the hidden
    rows of its positions in `logit_positions`, and the prompt ids those rows' logits are read at."""

    def __init__(self, asking: list[tuple[PromptParts, int, int]], rows: list[int], targets: list[int]):
        self.asking = asking  # (parts, first extra row, row count) per asking request
        self.rows = rows  # rows of the forward's hidden states, after the usual last rows
        self.targets = targets

    @classmethod
    def plan(cls, chunk: list, parts_of) -> PromptRows | None:
        """`chunk`: (request, start, ids) of the forward; `parts_of(request)`: its PromptParts, or None
        when it does not ask. None when no request of the chunk has a position to report here."""
        asking, rows, targets, offset = [], [], [], 0
        for r, start, ids in chunk:
            parts = parts_of(r)
            if parts is not None:
                want = parts.positions
                lo, hi = max(start, want.start), min(start + len(ids), want.stop)
                if lo < hi:
                    asking.append((parts, len(rows), hi - lo))
                    rows.extend(range(offset + lo - start, offset + hi - start))
                    targets.extend(r.prompt[lo + 1 : hi + 1])
            offset += len(ids)
        return cls(asking, rows, targets) if rows else None

    def take(self, logits: torch.Tensor) -> None:
        """The raw logits [len(rows), V] of `rows`: each asking request's part of them, on the device."""
        params = [parts.params for parts, _, n in self.asking for _ in range(n)]
        step = LogprobRows(params, logits.device).compute(logits, to_device(self.targets, logits.device, torch.int64))
        for parts, first, n in self.asking:
            k, j = parts.params.top_logprobs_num, len(parts.params.token_ids_logprob)
            span = slice(first, first + n)
            parts.parts.append(
                (step.token[span, 0], step.top_vals[span, 0, :k], step.top_ids[span, 0, :k], step.ids[span, 0, :j])
            )
