"""Penalties and logit bias, on the device, in the order of docs/architecture.md ("The order of logits
processing": before temperature and filters):

  1. repetition (HF's RepetitionPenaltyLogitsProcessor): every id seen in the prompt or the output
     so far has its logit divided by the penalty when positive, multiplied when negative;
  2. frequency and presence (OpenAI): logit -= frequency * count + presence * (count > 0), counting
     output tokens only;
  3. logit_bias: a per-request {id: bias} added to the logits.

`LogitProcessors` holds a batch's parameters as device tensors (built once per membership, like
SamplingBatch's); `PenaltyCounts` holds each request row's state on the device (ids seen in the
prompt, output counts), indexed by req_pool_idx and updated on the forward stream from the tokens
the step resolved, so the overlap keeps its lag and nothing waits for the host. In an EAGLE verify
each node is processed with the tokens on its own path (`apply_on_paths`). The prefill side, which
knows every id on the host, builds the state of its first token from the ids (`state_from_ids`).
"""

from __future__ import annotations

import torch

from common.forward.host_copy import to_device

MAX_LOGIT_BIAS = 1024  # entries per request: each is a scatter column on every step


def has_processors(params) -> bool:
    """Whether a request's SamplingParams ask for a penalty or a logit bias."""
    return (
        params.repetition_penalty != 1.0
        or bool(params.frequency_penalty or params.presence_penalty)
        or bool(params.logit_bias)
    )


def penalize(
    logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, rep: torch.Tensor, freq, pres
) -> torch.Tensor:
    """Steps 1-2 on logits [..., V] (float32) with the state broadcast to it: `seen` (bool: in the
    prompt or the output), `counts` (output occurrences, float); rep/freq/pres broadcastable [N, 1]."""
    rep_applied = torch.where(logits < 0, logits * rep, logits / rep)
    out = torch.where(seen, rep_applied, logits)
    return out - freq * counts - pres * (counts > 0).to(logits.dtype)


class LogitProcessors:
    """The processed rows of a batch (`rows`: batch positions) and their parameters on `device`."""

    def __init__(self, params: list, device: torch.device):
        rows = [i for i, p in enumerate(params) if has_processors(p)]
        ps = [params[i] for i in rows]
        self.rows_cpu = rows
        self.rows = to_device(rows, device, torch.int64)
        self.rep = to_device([[p.repetition_penalty] for p in ps], device, torch.float32)
        self.freq = to_device([[p.frequency_penalty] for p in ps], device, torch.float32)
        self.pres = to_device([[p.presence_penalty] for p in ps], device, torch.float32)
        width = max([len(p.logit_bias) for p in ps] + [0])
        self.bias_ids = self.bias_vals = None
        if width:
            items = [sorted(p.logit_bias.items()) for p in ps]
            self.bias_ids = to_device(
                [[t for t, _ in it] + [0] * (width - len(it)) for it in items], device, torch.int64
            )
            self.bias_vals = to_device(
                [[b for _, b in it] + [0.0] * (width - len(it)) for it in items], device, torch.float32
            )

    @classmethod
    def build(cls, params: list, device: torch.device) -> LogitProcessors | None:
        """None when no row has a penalty or a bias."""
        return cls(params, device) if any(has_processors(p) for p in params) else None

    def add_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """Step 3 on the processed rows' logits [P, V] or [P, M, V] (a new tensor)."""
        if self.bias_ids is None:
            return logits
        if logits.dim() == 2:
            return logits.scatter_add(1, self.bias_ids, self.bias_vals)
        m = logits.shape[1]
        return logits.scatter_add(
            2, self.bias_ids[:, None].expand(-1, m, -1), self.bias_vals[:, None].expand(-1, m, -1)
        )

    def apply(self, logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """logits [B, V] of the whole batch -> a copy with the processed rows processed, given their
        state [P, V] (PenaltyCounts.gather, or state_from_ids)."""
        sub = logits[self.rows].float()
        sub = self.add_bias(penalize(sub, seen, counts, self.rep, self.freq, self.pres))
        return logits.float().index_copy(0, self.rows, sub)

    def apply_on_paths(
        self, logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, anc: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """An EAGLE verify's logits [B, M, V] -> a copy where node m of a processed row is processed
        with its row's state [P, V] plus the tokens on its path: node j's token counts for node m when
        anc[b, m, j] (ancestor-or-self; node 0 is the pending bonus, not counted in the state yet).
        Only the columns of the row's node tokens differ from the base state, so those M columns are
        recomputed instead of materialising a state per node."""
        sub = logits[self.rows].float()  # [P, M, V]
        m = sub.shape[1]
        a, t = anc[self.rows].to(sub.dtype), tokens[self.rows]  # [P, M, M], [P, M]
        out = penalize(sub, seen[:, None], counts[:, None], self.rep[:, None], self.freq[:, None], self.pres[:, None])
        same = (t[:, :, None] == t[:, None, :]).to(sub.dtype)  # [P, j, k]: node j carries node k's token
        extra = torch.bmm(a, same)  # [P, m, k]: occurrences of token t_k on node m's path
        cols = t[:, None, :].expand(-1, m, -1)
        c = counts.gather(1, t)[:, None, :] + extra
        s = seen.gather(1, t)[:, None, :] | (extra > 0)
        fixed = penalize(sub.gather(2, cols), s, c, self.rep[:, None], self.freq[:, None], self.pres[:, None])
        out = self.add_bias(out.scatter(2, cols, fixed))
        return logits.float().index_copy(0, self.rows, out)


def state_from_ids(prompts: list[list[int]], outputs: list[list[int]], vocab_size: int, device) -> tuple:
    """(seen [N, V] bool, counts [N, V] float) of rows whose prompt and output ids are known on the
    host (prefill's first token: the output is what a retry resent)."""
    n = len(prompts)
    seen = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
    counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        ids = p + o
        if ids:  # index_fill_ takes the value as a scalar: no host copy (an indexed `= True` makes one on CUDA)
            seen[i].index_fill_(0, to_device(ids, device, torch.int64), True)
        if o:
            counts[i].index_put_((to_device(o, device, torch.int64),), torch.ones(len(o), device=device), True)
    return seen, counts


class PenaltyCounts:
    """Per request row (req_pool_idx) on the device: ids seen in the prompt, output counts. Made on
    first use (a vocabulary-wide row per request slot). Every method is stream work."""

    def __init__(self, num_rows: int, vocab_size: int, device):
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, torch.device(device)
        self.prompt_seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def _ensure(self) -> None:
        if self.counts is None:
            self.prompt_seen = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.bool, device=self.device)
            self.counts = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.float32, device=self.device)

    def seed(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A new request in `row`: its prompt (prompt + any output ids, for repetition) and its output
        ids so far (counted); the pending token is counted by the step that consumes it."""
        self._ensure()
        self.prompt_seen[row].fill_(False)
        self.counts[row].fill_(0)
        ids = prompt_ids + output_ids
        self.prompt_seen[row].index_fill_(0, to_device(ids, self.device, torch.int64), True)
        if output_ids:
            out = to_device(output_ids, self.device, torch.int64)
            self.counts[row].index_put_((out,), torch.ones(len(output_ids), device=self.device), True)

    def add(self, rows: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Count tokens [P] (or [P, K] with 0/1 weights of the same shape) in rows [P] (device)."""
        self._ensure()
        if tokens.dim() == 2:
            rows = rows[:, None].expand_as(tokens)
        w = torch.ones(tokens.shape, device=self.device) if weights is None else weights.to(torch.float32)
        self.counts.index_put_((rows.flatten(), tokens.flatten().to(torch.int64)), w.flatten(), accumulate=True)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen, counts) [P, V] of rows [P]: seen = in the prompt or counted in the output."""
        self._ensure()
        counts = self.counts[rows]
        return self.prompt_seen[rows] | (counts > 0), counts
