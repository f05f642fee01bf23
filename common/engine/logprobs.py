"""Output logprobs: the log-softmax of the target's raw logits (before penalties, bias, masks and
temperature: vLLM's default; docs/architecture.md, "The order of logits processing") for each output
token, with the top `top_logprobs_num` (<= MAX_TOP_LOGPROBS) candidates and the logprobs of the
request's `token_ids_logprob`.

Computed on the device only for the rows that ask (`LogprobRows`, built once per batch membership),
in the step that samples the tokens; the values go to the host with the step's tokens, behind the
same results-ready fence (`StepLogprobs.to_host`), so the step gains no host sync. A plain decode
step has one position per row; an EAGLE step has S + 1 (the nodes on the committed path, of which
the scheduler keeps the accepted ones). Prefill computes the first token's and ships it in the
handoff record (`TokenLogprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.forward.host_copy import to_device, to_host

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_TOKEN_IDS_LOGPROB = 64


@dataclass(frozen=True)  # no slots: a Handoff carrying one travels between TP ranks (tp_codec.py)
class TokenLogprobs:
    """One output token's logprobs, on the host."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first
    ids: tuple[float, ...] = ()  # logprobs of the request's token_ids_logprob, in its order


@dataclass
class StepLogprobs:
    """One step's logprobs of the rows that asked (`rows_cpu`: batch positions), per position L."""

    rows_cpu: list[int]
    token: torch.Tensor  # [P, L]
    top_vals: torch.Tensor  # [P, L, K]
    top_ids: torch.Tensor  # [P, L, K]
    ids: torch.Tensor  # [P, L, J]

    def to_host(self) -> StepLogprobs:
        """Non-blocking copies (read them after the step's results-ready fence)."""
        return StepLogprobs(self.rows_cpu, *(to_host(t) for t in (self.token, self.top_vals, self.top_ids, self.ids)))

    def lookup(self) -> dict[int, int]:
        """Batch position -> row of these tensors."""
        return {b: i for i, b in enumerate(self.rows_cpu)}

    def at(self, row: int, position: int, params) -> TokenLogprobs:
        """Host values of `row` (an index of these tensors) at `position`, cut to the request's own
        top_logprobs_num and token_ids_logprob."""
        k, j = params.top_logprobs_num, len(params.token_ids_logprob)
        vals = self.top_vals[row, position, :k].tolist()
        ids = self.top_ids[row, position, :k].tolist()
        return TokenLogprobs(
            float(self.token[row, position]), tuple(zip(ids, vals)), tuple(self.ids[row, position, :j].tolist())
        )


class LogprobRows:
    """The rows of a batch that ask for logprobs, and what they ask, on `device`."""

    def __init__(self, params: list, device: torch.device):
        rows = [i for i, p in enumerate(params) if p.return_logprob]
        ps = [params[i] for i in rows]
        self.rows_cpu = rows
        self.rows = to_device(rows, device, torch.int64)
        self.width = max([p.top_logprobs_num for p in ps] + [0])
        j = max([len(p.token_ids_logprob) for p in ps] + [0])
        self.ids = to_device([list(p.token_ids_logprob) + [0] * (j - len(p.token_ids_logprob)) for p in ps], device)
        self.ids = self.ids.to(torch.int64).view(len(rows), j)

    @classmethod
    def build(cls, params: list, device: torch.device) -> LogprobRows | None:
        return cls(params, device) if any(p.return_logprob for p in params) else None

    def compute(self, logits: torch.Tensor, tokens: torch.Tensor) -> StepLogprobs:
        """Raw logits [B, L, V] (or [B, V]) of the whole batch and the tokens they produced [B, L] (or
        [B]) -> the asking rows' logprobs (device tensors)."""
        if logits.dim() == 2:
            logits, tokens = logits[:, None], tokens[:, None]
        lp = torch.log_softmax(logits[self.rows].float(), dim=-1)  # [P, L, V]
        token = lp.gather(2, tokens[self.rows].to(torch.int64)[..., None]).squeeze(2)
        top_vals, top_ids = lp.topk(self.width, dim=-1) if self.width else (lp[..., :0], lp[..., :0].long())
        ids = lp.gather(2, self.ids[:, None, :].expand(-1, lp.shape[1], -1))
        return StepLogprobs(self.rows_cpu, token, top_vals, top_ids, ids)


def first_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list) -> list[TokenLogprobs | None]:
    """Prefill: each row's TokenLogprobs (None for rows that do not ask) of raw logits [N, V] and the
    sampled tokens [N]; host values (prefill copies its first tokens to the host here anyway)."""
    rows = LogprobRows.build(params, logits.device)
    out: list[TokenLogprobs | None] = [None] * len(params)
    if rows is None:
        return out
    step = rows.compute(logits, tokens)  # a blocking copy: prefill reads its tokens on the host here too
    step = StepLogprobs(step.rows_cpu, *(t.cpu() for t in (step.token, step.top_vals, step.top_ids, step.ids)))
    for i, b in enumerate(rows.rows_cpu):
        out[b] = step.at(i, 0, params[b])
    return out
