"""Expert load: the tokens the router sends to each expert of each MoE layer, counted on the device.

`ExpertLoad.attach` gives every sparse layer of a model (`SparseMoE`) a row of one persistent
[MoE layers, experts] int64 tensor on the model's device; each MoE forward (prefill extends, decode
steps, EAGLE verifies alike) adds its router's top-k ids into that row with one in-place index_add_
(`count_routed`): no host sync, one small temporary, and capturable in a CUDA graph (a kernel
on a fixed buffer). A token counts once per layer for each of its k experts: its (token, choice)
pairs. A fixed-shape forward (a replayed decode graph) pads its batch with rows at KV slot 0, the
slot no request owns: the runner hands each forward's slots in (`slots`, set before the model runs,
so a captured graph reads its static slot buffer), and a row at slot 0 counts nothing.

Only the host reads the counts, and only when metrics are scraped (`read`: one copy to the host, off
the forward's thread). Under tensor parallelism every rank runs the whole router on the same hidden
state (common/parallel/moe_shard.py), so rank 0's counts are the global ones: only rank 0 counts.
A draft model's MoE layer (DeepSeek-V3's NextN) is not counted. Warm-up forwards are wiped (`reset`).
"""

from __future__ import annotations

import torch


def count_routed(counts: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """counts [E] int64 += the number of times each expert appears in ids [T, k] (on the device); with
    `slots` (each token's KV slot [T]) the rows at the padding slot 0 left out."""
    flat = ids.reshape(-1)
    if slots is None:
        ones = torch.ones_like(flat, dtype=counts.dtype)
    else:
        ones = (slots != 0)[:, None].expand(ids.shape).reshape(-1).to(counts.dtype)
    counts.index_add_(0, flat, ones)


class ExpertLoad:
    def __init__(self, layers: tuple[int, ...], num_experts: int, device, ep_ranks: tuple[range, ...] = ()):
        self.layers = layers  # the decoder layer index of each row
        self.num_experts = num_experts
        self.counts = torch.zeros(len(layers), num_experts, dtype=torch.int64, device=device)
        self.ep_ranks = ep_ranks  # with --ep-size > 1: the experts each rank holds
        self.slots = None  # the running forward's KV slot per token (ModelRunner sets it): padding rows skipped

    @classmethod
    def attach(cls, model, tp=None, ep_size: int = 1) -> ExpertLoad | None:
        """Counters on `model`'s sparse layers; None for a dense model and on TP ranks other than 0."""
        from common.models.moe import SparseMoE
        from common.parallel.moe_shard import local_experts

        spec = model.config.moe
        if spec is None or (tp is not None and tp.rank != 0):
            return None
        moes = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)]
        if not moes:
            return None
        size = tp.size if tp is not None else 1
        ranks = tuple(local_experts(spec, r, size, ep_size) for r in range(size)) if ep_size > 1 else ()
        load = cls(tuple(i for i, _ in moes), spec.num_experts, moes[0][1].gate.weight.device, ranks)
        for row, (_, moe) in enumerate(moes):
            moe.load_counts, moe.expert_load = load.counts[row], load
        return load

    def reset(self) -> None:
        self.counts.zero_()

    def read(self) -> torch.Tensor:
        """The counts on the host [layers, experts] (a copy): the one host sync, made when scraped."""
        return self.counts.to("cpu", copy=True)


def imbalance(counts: torch.Tensor) -> list[float]:
    """Per layer of host counts [layers, experts]: its busiest expert's tokens over the mean (1 = even;
    num_experts / top_k at worst); 0 for a layer that has routed no token yet."""
    c = counts.double()
    mean = c.mean(dim=1)
    return torch.where(mean > 0, c.max(dim=1).values / mean.clamp(min=1e-30), 0.0).tolist()
