"""Multi-head latent attention (DeepSeek-V2/V3), absorbed: the KV cache holds one latent per token.

Parameters keep HF's names: `q_proj` (no `q_lora_rank`, as V2-Lite) or `q_a_proj` ->
`q_a_layernorm` -> `q_b_proj`; `kv_a_proj_with_mqa` (the latent c_kv and the shared rope key
k_pe), `kv_a_layernorm`, `kv_b_proj` (c_kv -> each head's k_nope and v), `o_proj`. The two low-rank
norms use eps 1e-6, as HF builds them.

What the pool keeps per token and layer is one "head" of kv_lora_rank + qk_rope_head_dim: the
normed c_kv and the rotated k_pe (ModelConfig: num_kv_heads 1, head_dim that width, no V of its own).
No per-head K or V is ever built. kv_b_proj's rows are split per head into W_UK [H, nope, R] and
W_UV [H, v, R] (views) and absorbed:
    score_h(s) = q_nope_h . (W_UK_h c_s) + q_pe_h . k_pe_s = [q_nope_h W_UK_h, q_pe_h] . [c_s, k_pe_s]
    out_h = sum_s p_s W_UV_h c_s = W_UV_h (sum_s p_s c_s)
so attention is multi-query over the latent, with the latent's first R columns as the value
(common/attention/latent.py; the triton backend's decode batches through its Triton kernel,
common/attention/triton_latent.py), then W_UV per head and o_proj. Prefill and decode both run this form.
Under tensor parallelism each rank keeps its query heads (their W_UK, W_UV and o_proj columns) and
the whole latent: the latent is the same on every rank, and o_proj's partial outputs are summed.

Rope: with `rope_interleave` (DeepSeek's default) HF rotates the pairs (x0, x1), (x2, x3), ... and
writes evens then odds: that is the half-split rotation of [x0, x2, ...; x1, x3, ...], so q_pe and
k_pe are de-interleaved first and take the shared `apply_rotary`. The softmax scale is
qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 under a scaled rope.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from common.attention.latent import latent_attention
from common.models.direct_call import DirectCall
from common.models.rope import apply_rotary, yarn_mscale


@dataclass(frozen=True)
class MlaSpec:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    scale: float  # the softmax scale, mscale included


def mla_spec(hf) -> MlaSpec:
    dims = {}
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(hf, name, None)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"field '{name}' must be a positive integer, got {value!r}")
        dims[name] = value
    if dims["qk_rope_head_dim"] % 2:
        raise ValueError("field 'qk_rope_head_dim' must be even")
    q_lora = getattr(hf, "q_lora_rank", None)
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise ValueError(f"field 'q_lora_rank' must be null or a positive integer, got {q_lora!r}")
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale = scale * m * m
    return MlaSpec(q_lora, rope_interleave=bool(getattr(hf, "rope_interleave", True)), scale=scale, **dims)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...]."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class KvB(nn.Module):
    """`kv_b_proj`, kept as a plain weight [H * (nope + v), R]: it is only ever read as W_UK and W_UV."""

    def __init__(self, rank: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, rank))


class MLAttention(DirectCall):
    tp = None  # a TPGroup once split by query heads (common/parallel/tp_shard.py); the latent stays whole

    def __init__(self, cfg, layer: int):
        from common.models.decoder import RMSNorm  # decoder imports this module

        super().__init__()
        m: MlaSpec = cfg.mla
        self.layer, self.spec, self.num_heads = layer, m, cfg.num_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        hidden, heads, bias = cfg.hidden_size, cfg.num_heads, cfg.qkv_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = KvB(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = nn.Linear(heads * m.v_head_dim, hidden, bias=cfg.o_bias)

    def forward(self, x, cos, sin, forward_batch, backend, residual=None) -> torch.Tensor:
        """o_proj(attention(x)), plus `residual` when given; writes this forward's latents into the pool."""
        from common.models.decoder import row_parallel

        m, t, heads = self.spec, x.shape[0], self.num_heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, heads, -1).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.view(t, 1, -1)
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe, cos, sin)
        latent = torch.cat((self.kv_a_layernorm(c_kv).view(t, 1, -1), k_pe), dim=-1)  # [T, 1, R + rope]
        w = self.kv_b_proj.weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
        query = torch.cat((q_latent, q_pe), dim=-1)
        attend = getattr(backend, "latent_attention", None)  # a backend's own kernel (triton), else the torch loop
        args = (query, latent, m.kv_lora_rank, self.layer, forward_batch, m.scale)
        out = attend(*args) if attend is not None else latent_attention(backend, *args)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return row_parallel(self.o_proj, out.reshape(t, heads * m.v_head_dim), residual, self.tp)
