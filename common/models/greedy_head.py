"""GreedyHead: the greedy token of fp32 hidden rows, reading the lm_head in bf16 (CPU).

At batch 1 a decode step streams every weight once, and the lm_head is its largest read
(SmolLM2-135M: 49152 x 576 fp32, 113 MB of the step's ~540 MB). A greedy row needs only the argmax of
its logits, and that can be found exactly from a cheaper pass:
1. approximate logits `a = bf16(h) @ bf16(W).T` through oneDNN (AMX / AVX512-BF16 where the host
   has them): half the bytes;
2. the K largest of each row (`torch.topk`);
3. a bound D on |exact - a| that holds for every vocabulary row (below): if the first candidate's
   lowest possible exact logit beats the K-th one's highest, every row outside the K is below the
   first candidate, so the exact argmax is among the K;
4. the K candidates' logits in fp32 from the fp32 weight (a gather and a bmm), argmax, ties to the
   lowest id (as torch.argmax over the whole vocabulary);
5. a row that fails 3 (or is not finite) takes the full fp32 lm_head.
So the token is the argmax of the fp32 logits, up to fp32 rounding of the kind in which the linear
layouts already differ (another summation order).

The bound, per row h (u = 2^-8, bf16's unit roundoff; norms over the hidden dimension):
- weights: |sum (w - bf16(w)) h| <= e * |h|, e = max over vocabulary rows of |w - bf16(w)| (float64);
- input: |sum bf16(w) (h - bf16(h))| <= b * |h - bf16(h)|, b = max over rows of |bf16(w)|;
- fp32 accumulation of the bf16 products (exact in fp32): <= gamma * b * |bf16(h)|, gamma = 4 H 2^-24
  (the classic H * 2^-24, four times over);
- output rounding to bf16: |a - a_fp32| <= c |a|, c = 2u / (1 - 2u): twice what rounding to nearest
  gives, so a conversion that truncates is covered too.
With D = e |h| + b (|h - bf16(h)| + gamma |bf16(h)|): the first candidate's exact logit is at least
v1 - c|v1| - D, and any row outside the K at most vK + c|vK| + D (vK: the K-th approximate value).

At one or two rows of a fused decode step the same search runs inside the step's call, with float32 inputs
and the lm_head in bf16 (common/kernels/cpu_candidates.cpp; cpu_step.FusedLayers.takes_head).

`plan[i]` says, per row bucket of packed_linear.ROW_BUCKETS, whether the head runs (chosen by
measurement at start-up, `linear_tuning.tune_greedy`): on a host without fast bf16 it loses to the
fp32 lm_head and is not used.
"""

from __future__ import annotations

import logging

import torch

from common.models.packed_linear import BATCH_HINT, ROW_BUCKETS, LinearWeight, bucket_index

log = logging.getLogger(__name__)

CANDIDATES = 32  # K: SmolLM2's decode rows needed 1-14 under the bound


def available() -> bool:
    """oneDNN bf16 GEMMs on this host (the fallback is what runs otherwise: nothing to gain)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class GreedyHead:
    def __init__(self, lm_head: LinearWeight, candidates: int = CANDIDATES):
        self.lm_head = lm_head  # the fp32 weight: candidates' exact logits and the fallback
        weight = lm_head.weight
        self.k = min(candidates, weight.shape[0])
        low = weight.to(torch.bfloat16)
        self.weight_err = self.low_norm = 0.0  # e and b, in float64 a block of rows at a time
        for w, lw in zip(weight.split(4096), low.split(4096)):
            if not bool(torch.isfinite(w).all()):
                raise ValueError("the lm_head has non-finite weights: no bound holds")
            self.weight_err = max(self.weight_err, float((w.double() - lw.double()).norm(dim=1).max()))
            self.low_norm = max(self.low_norm, float(lw.double().norm(dim=1).max()))
        self.packed = torch.ops.mkldnn._reorder_linear_weight(low, BATCH_HINT)
        self.gamma = 4 * weight.shape[1] * 2.0**-24
        self.plan = (False,) * len(ROW_BUCKETS)
        self.fallback_rows = 0  # rows the bound could not settle (they took the fp32 lm_head)

    @classmethod
    def build(cls, lm_head: LinearWeight) -> GreedyHead | None:
        """The head, or None (logged) for an lm_head it cannot bound."""
        try:
            return cls(lm_head)
        except ValueError as e:
            log.warning("no greedy head: %s", e)
            return None

    def set_plan(self, plan: tuple[bool, ...]) -> None:
        if len(plan) != len(ROW_BUCKETS):
            raise ValueError(f"a greedy-head plan has one entry per row bucket {ROW_BUCKETS}, got {plan}")
        self.plan = tuple(bool(p) for p in plan)

    def used_for(self, rows: int) -> bool:
        return self.plan[bucket_index(rows)]

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] fp32 -> the argmax of its fp32 logits [R] (int64)."""
        ids, safe = self.candidates(hidden)
        tokens = self.pick(hidden, ids)
        if not bool(safe.all()):
            rows = (~safe).nonzero().squeeze(1)
            self.fallback_rows += len(rows)
            tokens[rows] = self.lm_head(hidden[rows]).argmax(dim=-1)
        return tokens

    def candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the K candidate ids of each row [R, K], whether the bound proves the argmax among them [R])."""
        low = hidden.to(torch.bfloat16)
        approx = torch.ops.mkldnn._linear_pointwise(low, self.packed, None, "none", [], "")
        values, ids = torch.topk(approx, self.k, dim=1)
        first, kth = values[:, 0].float(), values[:, -1].float()
        c = 2.0**-7 / (1 - 2.0**-7)  # the output's rounding (2u: see the module docstring)
        if self.k == approx.shape[1]:  # every row is a candidate: only non-finite rows need the fallback
            return ids, torch.isfinite(first)
        margin = (first - c * first.abs()) - (kth + c * kth.abs())
        return ids, margin > 2 * self.bound(hidden, low)  # False where anything is NaN or infinite

    def bound(self, hidden: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """D per row [R]: |exact logit - the bf16 pass's logit before its output rounding| <= D."""
        low32 = low.float()
        d = self.weight_err * hidden.norm(dim=1) + self.low_norm * (
            (hidden - low32).norm(dim=1) + self.gamma * low32.norm(dim=1)
        )
        return d * 1.001 + 1e-6  # the norms themselves in fp32

    def pick(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The candidate with the largest fp32 logit, the lowest id among equals."""
        ids = ids.sort(dim=1).values
        rows = self.lm_head.weight.index_select(0, ids.flatten()).view(*ids.shape, -1)  # [R, K, H]
        exact = torch.bmm(rows, hidden.unsqueeze(2)).squeeze(2)
        return ids.gather(1, exact.argmax(dim=1, keepdim=True)).squeeze(1)
