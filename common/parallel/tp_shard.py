"""Split a loaded DecoderLM across a TPGroup (Megatron-style), in place, before CPU packing.

Rank r of N keeps:
1. attention: query heads [r*H/N, (r+1)*H/N) and the KV heads they read. With N <= KV heads each
   rank owns KV/N of them; with more ranks than KV heads each KV head is replicated on N/KV ranks
   (`kv_heads_of`). qkv_proj keeps those rows (column-parallel); o_proj keeps the matching columns
   (row-parallel) and its bias on rank 0 only; the partial outputs are summed by one all-reduce;
2. MLP: gate/up rows [r*I/N, (r+1)*I/N) and those down_proj columns (bias on rank 0), one all-reduce;
3. embedding and lm_head: vocabulary rows [r*S, (r+1)*S) with S = ceil(V/N), zero-padded to S:
   a token outside a rank's rows embeds to 0 there, so the all-reduce gives its row; each rank's
   logits columns are all-gathered (padding cut), so every rank has the full logits.
Every rank's KV pool holds only its KV heads (`kv_heads_of(...)` is what a KV handoff sends it);
`gather_kv_heads` puts a prefill's whole KV together for its handoff.
DeepSeek-V3's latent attention splits by query heads too (q_b_proj / kv_b_proj rows per head, o_proj
row-parallel); its latent KV head is computed whole on every rank and kept whole in every rank's
pool (`replicated_kv`). Mixtures of experts split as common/parallel/moe_shard.py says (`--ep-size`).
Sums over ranks reorder float additions: results equal TP 1 within rounding (the tests check tokens
against HF greedy). The whole checkpoint is read on every rank, then cut (sharded reading is left).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from common.models.config import ModelConfig
from common.models.moe import SparseMoE
from common.parallel.tp_group import TPGroup


def check_divisible(cfg: ModelConfig, size: int) -> None:
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    if heads % size or cfg.intermediate_size % size or (kv % size and size % kv):
        raise ValueError(
            f"--tp-size {size} must divide the {heads} attention heads and the MLP's {cfg.intermediate_size} "
            f"columns, and divide or be a multiple of the {kv} KV heads"
        )


def kv_heads_of(cfg: ModelConfig, rank: int, size: int) -> range:
    """The KV heads rank `rank` of `size` holds (a replicated head when size > KV heads). MLA's one
    latent head is the same on every rank (`replicated_kv`): every rank holds it whole."""
    kv = cfg.num_kv_heads
    if replicated_kv(cfg):
        return range(0, kv)
    if size <= kv:
        return range(rank * kv // size, (rank + 1) * kv // size)
    first = rank * kv // size
    return range(first, first + 1)


def replicated_kv(cfg: ModelConfig) -> bool:
    """Whether every rank holds the whole KV cache: MLA's latent (one head computed from the whole
    hidden state, never split by query heads). A handoff then reads it from one rank and writes it
    whole to every rank."""
    return cfg.mla is not None


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, vocab: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [S, H], rows start.. (zero padded)
        self.start, self.vocab, self.tp = start, vocab, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[..., None]
        return self.tp.all_reduce(out)


def _rows(weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """weight[start:start+count] zero-padded to count rows."""
    part = weight[start : start + count]
    if part.shape[0] < count:
        part = torch.cat([part, part.new_zeros(count - part.shape[0], *part.shape[1:])])
    return part.clone()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    out.weight.data.copy_(weight)
    if bias is not None:
        out.bias.data.copy_(bias)
    return out.requires_grad_(False)


def shard_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    """A dense MLP (gate_up_proj, down_proj) cut to rank tp.rank's columns, in place; its `tp` is the
    caller's to set (a MoE's shared experts leave it None: moe_shard.py sums them with the experts)."""
    r, n = tp.rank, tp.size
    gw, gb = mlp.gate_up_proj.weight.data, mlp.gate_up_proj.bias
    width = gw.shape[0] // 2
    inter = width // n
    cols = torch.arange(r * inter, (r + 1) * inter, device=gw.device)
    gu_rows = torch.cat([cols, cols + width])
    mlp.gate_up_proj = _linear(gw[gu_rows], None if gb is None else gb.data[gu_rows])
    dw, db = mlp.down_proj.weight.data, mlp.down_proj.bias
    mlp.down_proj = _linear(dw[:, cols], db.data if db is not None and r == 0 else None)


def _shard_attention(attn: nn.Module, cfg: ModelConfig, tp: TPGroup) -> None:
    r, n, d = tp.rank, tp.size, cfg.head_dim
    heads = cfg.num_heads // n
    kv = kv_heads_of(cfg, r, n)
    w, b = attn.qkv_proj.weight.data, attn.qkv_proj.bias
    q_rows = torch.arange(r * heads * d, (r + 1) * heads * d)
    k_rows = cfg.q_size + torch.arange(kv.start * d, kv.stop * d)
    rows = torch.cat([q_rows, k_rows, k_rows + cfg.kv_size]).to(w.device)
    attn.qkv_proj = _linear(w[rows], None if b is None else b.data[rows])
    attn.num_heads, attn.num_kv_heads = heads, len(kv)
    attn.qkv_sizes = [heads * d, len(kv) * d, len(kv) * d]
    o = attn.o_proj
    attn.o_proj = _linear(o.weight.data[:, q_rows.to(w.device)], o.bias.data if o.bias is not None and r == 0 else None)
    attn.tp = tp


def _shard_mla(attn: nn.Module, cfg: ModelConfig, tp: TPGroup) -> None:
    """DeepSeek's latent attention (common/models/mla.py) by query heads: q_proj / q_b_proj and
    kv_b_proj keep their heads' rows (W_UK and W_UV per head), o_proj the matching columns (row-
    parallel). The low-rank parts (q_a_proj and its norm, kv_a_proj_with_mqa, kv_a_layernorm) stay
    whole: every rank computes the same latent and keeps it whole in its pool (the replicated head)."""
    m, r, n = cfg.mla, tp.rank, tp.size
    heads = cfg.num_heads // n

    def head_rows(per_head: int, device) -> torch.Tensor:
        return torch.arange(r * heads * per_head, (r + 1) * heads * per_head, device=device)

    name = "q_proj" if hasattr(attn, "q_proj") else "q_b_proj"
    q = getattr(attn, name)
    rows = head_rows(m.qk_nope_head_dim + m.qk_rope_head_dim, q.weight.device)
    setattr(attn, name, _linear(q.weight.data[rows], None if q.bias is None else q.bias.data[rows]))
    kv_b = attn.kv_b_proj.weight.data
    attn.kv_b_proj.weight = nn.Parameter(
        kv_b[head_rows(m.qk_nope_head_dim + m.v_head_dim, kv_b.device)].clone(), requires_grad=False
    )
    o = attn.o_proj
    cols = head_rows(m.v_head_dim, o.weight.device)
    attn.o_proj = _linear(o.weight.data[:, cols], o.bias.data if o.bias is not None and r == 0 else None)
    attn.num_heads = heads
    attn.tp = tp


def shard_model(model: nn.Module, tp: TPGroup, ep_size: int = 1) -> nn.Module:
    """Cut `model` (a DecoderLM with full weights) to rank tp.rank's part; returns it. `ep_size`: how a
    mixture of experts is split (common/parallel/moe_shard.py)."""
    from common.parallel import moe_shard

    if tp.size == 1:
        return model
    cfg: ModelConfig = model.config
    check_divisible(cfg, tp.size)
    moe_shard.check_experts(cfg.moe, tp.size, ep_size)
    r, n = tp.rank, tp.size
    for layer in model.model.layers:
        if cfg.mla is None:
            _shard_attention(layer.self_attn, cfg, tp)
        else:
            _shard_mla(layer.self_attn, cfg, tp)
        if isinstance(layer.mlp, SparseMoE):
            moe_shard.shard_moe(layer.mlp, tp, ep_size, shard_mlp)
        else:
            shard_mlp(layer.mlp, tp)
            layer.mlp.tp = tp
    shard = -(-cfg.vocab_size // n)
    start = r * shard
    lm_head = None if cfg.tie_word_embeddings else _rows(model.lm_head.weight.data, start, shard)
    embed = VocabParallelEmbedding(_rows(model.model.embed_tokens.weight.data, start, shard), start, cfg.vocab_size, tp)
    model.model.embed_tokens = embed
    if lm_head is not None:
        model.lm_head = _linear(lm_head, None)
    model.tp = tp
    return model


def gather_kv_heads(tp: TPGroup, cfg: ModelConfig, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's KV tensors [T, its KV heads, D] (one per layer) -> the whole KV [T, KV heads, D]
    per layer on every rank, in head order (one all-gather for all layers; a replicated head is
    taken from the first rank holding it)."""
    if tp.size == 1 or replicated_kv(cfg):  # the latent: this rank's is every rank's (no collective)
        return tensors
    parts = tp.all_gather(torch.stack(tensors))  # [L, T, h, D] of every rank
    by_head = {}
    for rank, part in enumerate(parts):
        for i, head in enumerate(kv_heads_of(cfg, rank, tp.size)):
            by_head.setdefault(head, part[:, :, i])
    whole = torch.stack([by_head[h] for h in range(cfg.num_kv_heads)], dim=2)  # [L, T, KV heads, D]
    return list(whole.unbind(0))
