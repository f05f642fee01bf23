"""Mixture of experts (Qwen3-MoE, DeepSeek-V3): the router, the routed experts, the shared experts.

`moe_spec` reads a config's expert fields into a `MoeSpec`: which layers are sparse (Qwen3-MoE:
`decoder_sparse_step` and `mlp_only_layers`; DeepSeek-V3: every layer from `first_k_dense_replace`),
the experts' width, top-k and the scoring:
- `softmax` (Qwen3-MoE): softmax over every expert's logit in fp32, the top k, renormalized to sum
  1 when `norm_topk_prob`;
- `sigmoid` (DeepSeek-V3): sigmoid scores; the choice adds `e_score_correction_bias` and is limited
  to the `topk_group` best of `n_group` groups (a group's score: its best two), the weights are the
  plain scores of the chosen experts, renormalized when `norm_topk_prob`, times
  `routed_scaling_factor`.
The router's linear runs in fp32 whatever the model's dtype, as HF's does.

The experts' weights are held stacked ([E, 2I, H] gate+up, [E, H, I] down) and loaded from the
published per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, ...; `checkpoint_names`). The
kernel (`run_experts`): the (token, choice) pairs sorted by expert, the tokens gathered once in that
order, one GEMM pair per expert that got tokens, each row scaled by its routing weight, and one
index_add_ back to the tokens (expert by expert, as HF's eager experts add them). It reads each
expert's row count on the host (a sync per layer); under `--attention-backend triton` the runner swaps
in common/models/triton_moe.py's grouped GEMM (`experts_kernel`), which computes the same on the device.

Under tensor parallelism (common/parallel/moe_shard.py) every rank routes the same tokens (the
hidden state is the same on every rank after attention's all-reduce) and runs its part of the
experts: with expert parallelism 1 a slice of every expert's intermediate columns, with expert
parallelism = the TP size its own experts whole (`first_expert` on: pairs routed elsewhere are
skipped). Either way each rank's output is a partial sum (with the shared experts' partial output
added), and one all-reduce sums it: no token moves, since every rank already holds every token.

`load_counts` (common/models/expert_load.py): when set, the router's choices are counted on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from common.models.direct_call import DirectCall
from common.models.expert_load import count_routed


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    norm_topk_prob: bool
    scoring: str  # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    sparse_layers: tuple[int, ...]
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0


def _positive(hf, name: str) -> int:
    value = getattr(hf, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"field '{name}' must be a positive integer, got {value!r}")
    return value


def moe_spec(arch: str, hf) -> MoeSpec:
    """The expert fields of a Qwen3MoeForCausalLM or DeepseekV3ForCausalLM config (ValueError naming the field)."""
    layers = range(hf.num_hidden_layers)
    if arch == "Qwen3MoeForCausalLM":
        experts, step = _positive(hf, "num_experts"), _positive(hf, "decoder_sparse_step")
        dense = set(getattr(hf, "mlp_only_layers", None) or [])
        spec = MoeSpec(
            num_experts=experts,
            top_k=_positive(hf, "num_experts_per_tok"),
            intermediate_size=_positive(hf, "moe_intermediate_size"),
            norm_topk_prob=bool(hf.norm_topk_prob),
            scoring="softmax",
            sparse_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
        )
    else:  # DeepseekV3ForCausalLM
        if getattr(hf, "topk_method", "noaux_tc") != "noaux_tc" or getattr(hf, "scoring_func", "sigmoid") != "sigmoid":
            raise ValueError("only DeepSeek-V3's routing (sigmoid scores, noaux_tc top-k) is supported")
        first_dense = getattr(hf, "first_k_dense_replace", 0) or 0
        spec = MoeSpec(
            num_experts=_positive(hf, "n_routed_experts"),
            top_k=_positive(hf, "num_experts_per_tok"),
            intermediate_size=_positive(hf, "moe_intermediate_size"),
            norm_topk_prob=bool(hf.norm_topk_prob),
            scoring="sigmoid",
            sparse_layers=tuple(i for i in layers if i >= first_dense),
            n_group=_positive(hf, "n_group"),
            topk_group=_positive(hf, "topk_group"),
            routed_scaling_factor=float(hf.routed_scaling_factor),
            n_shared_experts=getattr(hf, "n_shared_experts", 0) or 0,
        )
        if spec.num_experts % spec.n_group or spec.topk_group > spec.n_group:
            raise ValueError(f"n_group={spec.n_group} must divide n_routed_experts and hold topk_group")
        if spec.top_k > spec.topk_group * spec.num_experts // spec.n_group:
            raise ValueError("num_experts_per_tok exceeds the experts of topk_group groups")
    if spec.top_k > spec.num_experts:
        raise ValueError(f"num_experts_per_tok={spec.top_k} exceeds the {spec.num_experts} experts")
    return spec


class Router(DirectCall):
    """HF's `mlp.gate`: weight [E, H] (and DeepSeek-V3's `e_score_correction_bias` [E])."""

    def __init__(self, hidden: int, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden))
        if spec.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        spec = self.spec
        logits = F.linear(x.float(), self.weight.float())
        if spec.scoring == "softmax":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, spec.top_k, dim=-1)
            if spec.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, ids
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        t, groups = x.shape[0], spec.n_group
        grouped = choice.view(t, groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, spec.topk_group, dim=-1)[1], 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(spec.num_experts // groups, dim=1), float("-inf"))
        ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * spec.routed_scaling_factor, ids


def run_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first_expert: int | None = None,
) -> torch.Tensor:
    """sum over each token's k experts of weight * down(silu(gate) * up): x [T, H], ids / weights [T, k],
    gate_up [E, 2I, H], down [E, H, I] -> [T, H]. Rows sorted by expert: one gather, a GEMM pair per
    expert with tokens, one scatter-add. With `first_expert` (expert parallelism) the stacked weights
    are experts [first_expert, first_expert + E) alone: pairs routed to other experts are left out."""
    k, local = ids.shape[1], gate_up.shape[0]
    flat = ids.reshape(-1)
    pairs = None
    if first_expert is not None:
        flat = flat - first_expert
        pairs = torch.nonzero((flat >= 0) & (flat < local)).squeeze(1)  # this rank's (token, choice) pairs
        flat = flat.index_select(0, pairs)
    order = torch.argsort(flat, stable=True)
    if pairs is not None:
        order = pairs.index_select(0, order)  # sorted pairs, as indices into the [T * k] pairs
    tokens = order // k  # the token of each sorted row
    rows = x.index_select(0, tokens)
    counts = torch.bincount(flat, minlength=local).tolist()
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(rows[start : start + n], gate_up[e]).chunk(2, dim=-1)
            out[start : start + n] = F.linear(F.silu(gate) * up, down[e])
            start += n
    out.mul_(weights.reshape(-1)[order].to(out.dtype)[:, None])
    return torch.zeros_like(x).index_add_(0, tokens, out)


class SparseMoE(DirectCall):
    """HF's sparse MLP block: `gate` (the router), the routed experts (stacked) and, with DeepSeek-V3,
    `shared_experts` (a dense MLP every token runs)."""

    tp = None  # a TPGroup once split: the output is this rank's partial sum until the all-reduce
    first_expert = None  # expert parallelism: the global id of this rank's first expert
    load_counts = None  # [E] int64 on the device: tokens routed to each expert (common/models/expert_load.py)
    expert_load = None  # the ExpertLoad holding load_counts (its `slots`: which rows are padding)
    experts_kernel = None  # run_experts' replacement: the Triton grouped GEMM (common/models/triton_moe.py)

    def __init__(self, hidden: int, spec: MoeSpec, shared: nn.Module | None = None):
        super().__init__()
        e, inter = spec.num_experts, spec.intermediate_size
        self.gate = Router(hidden, spec)
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(e, hidden, inter))
        if shared is not None:
            self.shared_experts = shared

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.load_counts is not None:
            count_routed(self.load_counts, ids, self.expert_load.slots if self.expert_load is not None else None)
        kernel = self.experts_kernel or run_experts
        out = kernel(x, ids, weights, self.experts_gate_up, self.experts_down, self.first_expert)
        if hasattr(self, "shared_experts"):  # under TP its partial output (its own tp stays None)
            out = out + self.shared_experts(x)
        if self.tp is not None:  # every rank's partial sums (routed and shared) added: one all-reduce
            out = self.tp.all_reduce(out)
        return out if residual is None else residual + out


def checkpoint_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (name -> destination) with each stacked expert parameter named as the published
    per-expert tensors: `...mlp.experts.{e}.gate_proj.weight` / `up_proj` / `down_proj`, views of it."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts_gate_up"):
            base = name.removesuffix("_gate_up")
            for e, expert in enumerate(t.unbind(0)):
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = expert.chunk(2, dim=0)
        elif name.endswith(".experts_down"):
            base = name.removesuffix("_down")
            out.update({f"{base}.{e}.down_proj.weight": w for e, w in enumerate(t.unbind(0))})
        else:
            out[name] = t
    return out
