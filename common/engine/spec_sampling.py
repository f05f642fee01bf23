"""Speculative sampling for EAGLE chains (temperature > 0): the output follows the target's
distribution exactly, whatever the head proposes.

For a request with committed length n and drafts d1..dS, each drawn from the head's distribution
q_k, and the target's distributions p_0..p_S from one verify forward (p_j is the target's next-token
distribution after the first j drafts; both with the request's temperature, top-k, top-p and min-p
applied and renormalised):
  1. accept d_k while u_k < p_{k-1}(d_k) / q_k(d_k) (u_k uniform), so A drafts are accepted;
  2. the bonus token: if some draft was rejected (A < S), draw from the residual
     norm(max(0, p_A - q_{A+1})); if all were accepted, draw from p_S.
Every uniform comes from (request seed, output position, purpose) (`SpecDraws`), so a run is
reproducible from its seeds and independent of batching. Greedy requests never come here: the
EAGLE step keeps its argmax rule for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.sampling import SamplingParams, keep_sorted, sorted_candidates, topk_width, uniform
from common.forward.host_copy import to_device

# Purposes of a uniform draw, mixed into the request's seed (any distinct 64-bit values).
DRAFT, ACCEPT, BONUS = 0x5D1A_F7C3_0000_0001, 0x5D1A_F7C3_0000_0002, 0x5D1A_F7C3_0000_0003


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    filters: bool = True,
    width: int | None = None,
) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] with temperature, then top-k / top-p / min-p (params [N, 1];
    top_k >= V for off), renormalised; the most likely token always survives. `filters=False`: no
    row filters (temperature only), so no sort; `width`: no row keeps more candidates (its top-k), so
    only that many are sorted."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if not filters:
        return probs
    sorted_probs, order = sorted_candidates(probs, width)
    keep = keep_sorted(sorted_probs, top_k, top_p, min_p)
    kept = torch.zeros_like(probs).scatter_(1, order, torch.where(keep, sorted_probs, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one id per row of probs [N, V] with uniforms u [N]; only ids of mass > 0."""
    cdf = torch.cumsum(probs, dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    return torch.minimum(pick, (probs > 0).cumsum(-1).argmax(-1))  # float edge: not past the last kept id


def verify_chain(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor, u_bonus: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept/reject rule. p [R, S+1, V] target, q [R, S, V] draft distributions, drafts [R, S]
    (d_k drawn from q_k), u_accept [R, S], u_bonus [R, S+1] (the draw for a bonus at index j).
    Returns (A [R] drafts accepted, bonus [R])."""
    rows, steps = drafts.shape
    lanes = torch.arange(rows, device=drafts.device)
    p_tok = p[:, :steps].gather(2, drafts[..., None]).squeeze(2)
    q_tok = q.gather(2, drafts[..., None]).squeeze(2)
    ok = u_accept * q_tok < p_tok  # u < p/q without dividing by a tiny q
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[lanes, accepted]  # q_{A+1}, or 0 if A == S
    p_here = p[lanes, accepted]
    residual = (p_here - q_next).clamp_(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q: nothing left, draw from p
    residual = torch.where(empty, p_here, residual)
    bonus = draw(residual / residual.sum(-1, keepdim=True), u_bonus[lanes, accepted])
    return accepted, bonus


@dataclass
class SpecDraws:
    """The sampled lanes of one EAGLE step and everything drawn for them, made on the schedule side
    (CPU) and moved to the device inside the step. Lanes are batch positions of requests with
    temperature > 0; their params are [R, 1]; uniforms per draft step, accept test and bonus index."""

    lanes: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    u_draft: torch.Tensor  # [R, S]
    u_accept: torch.Tensor  # [R, S]
    u_bonus: torch.Tensor  # [R, S+1]
    filters: bool = True  # some lane has top-k / top-p / min-p
    width: int | None = None  # every lane keeps at most this many candidates (top-k): sort only those

    @classmethod
    def build(
        cls, params: list[SamplingParams], seeds: list[int], output_index: list[int], num_steps: int, vocab_size: int
    ) -> SpecDraws | None:
        """None when every request is greedy. output_index[i]: output index of lane i's pending bonus
        token (the token at its committed length); draft k sits at output_index + k."""
        lanes = [i for i, sp in enumerate(params) if not sp.greedy]
        if not lanes:
            return None
        ps = [params[i] for i in lanes]

        def table(purpose, count, offset):
            return torch.tensor(
                [[uniform(seeds[i] ^ purpose, output_index[i] + offset + k) for k in range(count)] for i in lanes],
                dtype=torch.float32,
            )

        return cls(
            torch.tensor(lanes),
            torch.tensor([[sp.temperature] for sp in ps]),
            torch.tensor([[sp.top_k if sp.top_k > 0 else vocab_size] for sp in ps]),
            torch.tensor([[sp.top_p] for sp in ps]),
            torch.tensor([[sp.min_p] for sp in ps]),
            table(DRAFT, num_steps, 1),
            table(ACCEPT, num_steps, 1),
            table(BONUS, num_steps + 1, 1),
            any(sp.filtered for sp in ps),
            topk_width(ps),
        )

    def to(self, device) -> SpecDraws:
        moved = {f: getattr(self, f) for f in self.__dataclass_fields__}
        moved.update({f: to_device(t, device) for f, t in moved.items() if isinstance(t, torch.Tensor)})
        return SpecDraws(**moved)

    def probs(self, logits: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """Filtered probabilities of logits [R * repeat, V] (lane-major), each lane's params repeated."""
        expand = (lambda t: t.repeat_interleave(repeat, dim=0)) if repeat > 1 else (lambda t: t)
        return filtered_probs(
            logits,
            expand(self.temperature),
            expand(self.top_k),
            expand(self.top_p),
            expand(self.min_p),
            self.filters,
            self.width,
        )
