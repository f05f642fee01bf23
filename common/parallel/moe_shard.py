"""Mixture-of-experts layers split across a TPGroup (`--ep-size`), in place, before CPU packing.

Every rank routes every token (the router is whole on each rank, and its input, the hidden state after
attention's all-reduce, is the same on each), so no token has to travel to its experts; what is
split is the experts' weights, and one all-reduce sums every rank's partial output:
1. `--ep-size 1` (tensor-parallel experts): each rank keeps columns [r*I/N, (r+1)*I/N) of every
   expert's intermediate width: those rows of gate and up, those columns of down. Every expert
   runs on every rank, on 1/N of its width;
2. `--ep-size N` (= --tp-size; expert parallelism): rank r keeps experts [r*E/N, (r+1)*E/N) whole
   and runs only the (token, choice) pairs routed to them (`SparseMoE.first_expert`); a token's
   other choices are summed in on the ranks that own them;
3. DeepSeek's shared experts: split as a dense MLP (columns), their partial output added to the
   routed one before the same all-reduce (one all-reduce per MoE layer in both modes).
Results equal one rank's within rounding (the all-reduce reorders the sum of a token's experts).
With attention split by heads the hidden state is already on every rank, so the "all-gather of the
routed tokens" of a dispatch is a no-op and the reduce is that all-reduce; an all-to-all dispatch
pays off only once attention is data-parallel (tokens split across ranks), which is not built.
"""

from __future__ import annotations

import torch
from torch import nn

from common.models.moe import MoeSpec, SparseMoE


def check_experts(spec: MoeSpec | None, tp_size: int, ep_size: int) -> None:
    """ValueError unless `--ep-size` is 1 or the TP size and the experts split evenly."""
    if ep_size not in (1, tp_size):
        raise ValueError(f"--ep-size must be 1 or --tp-size ({tp_size}), got {ep_size}")
    if spec is None or tp_size == 1:
        return
    if ep_size == 1 and spec.intermediate_size % tp_size:
        raise ValueError(
            f"--tp-size {tp_size} with --ep-size 1 must divide each expert's {spec.intermediate_size} columns"
        )
    if ep_size > 1 and spec.num_experts % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide the {spec.num_experts} routed experts")
    if (spec.intermediate_size * spec.n_shared_experts) % tp_size:
        raise ValueError(f"--tp-size {tp_size} must divide the shared experts' columns")


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.clone(), requires_grad=False)


def shard_moe(moe: SparseMoE, tp, ep_size: int, shard_mlp) -> None:
    """Cut `moe` to rank tp.rank's part (`shard_mlp(mlp, tp)`: tp_shard's column split of a dense MLP,
    for the shared experts, whose own tp stays None: their output is summed with the routed one)."""
    spec: MoeSpec = moe.gate.spec
    r, n = tp.rank, tp.size
    check_experts(spec, n, ep_size)
    gate_up, down = moe.experts_gate_up.data, moe.experts_down.data  # [E, 2I, H], [E, H, I]
    if ep_size == 1:
        inter = spec.intermediate_size // n
        cols = torch.arange(r * inter, (r + 1) * inter, device=gate_up.device)
        moe.experts_gate_up = _param(gate_up[:, torch.cat([cols, cols + spec.intermediate_size])])
        moe.experts_down = _param(down[:, :, cols])
    else:
        per = spec.num_experts // n
        moe.experts_gate_up = _param(gate_up[r * per : (r + 1) * per])
        moe.experts_down = _param(down[r * per : (r + 1) * per])
        moe.first_expert = r * per
    if hasattr(moe, "shared_experts"):
        shard_mlp(moe.shared_experts, tp)
    moe.tp = tp


def local_experts(spec: MoeSpec, rank: int, size: int, ep_size: int) -> range:
    """The routed experts rank `rank` runs (whole with expert parallelism, a slice of each without)."""
    if ep_size == 1:
        return range(spec.num_experts)
    per = spec.num_experts // size
    return range(rank * per, (rank + 1) * per)
