"""MLA's absorbed decode attention over the latent pool, in Triton (the triton backend's DECODE batches).

The torch loop (common/attention/latent.py) scores each request's queries against the latents of its
KV slots; this kernel does the same for one query per request, reading the latents in place through
req_to_token (no gather, no per-head K or V). A query row is [q_nope W_UK (rank), q_pe (rope)] per
head; a pool row is [normed c_kv (rank), k_pe (rope)], one per token and layer, shared by every head
(multi-query). One program per (request, block of BLOCK_H heads, split): each latent block is loaded
once for all the block's heads, scored as q_nope . c + q_pe . k_pe (two dots, so neither part is
padded to the other's width), softmaxed online with the model's scale, and its c columns are the
value: the output is in latent space, [B, H, rank] (W_UV and o_proj follow in common/models/mla.py).
Split-K as the GQA decode kernel (common/attention/triton_kernels.py), whose online softmax and
split merge it shares. Everything it reads is a device tensor (rows, seq_lens from the batch), so it
syncs nothing with the host. On CPU it runs under Triton's interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.attention.triton_kernels import _block_d, _dot, _launches, _merge_splits, _online_softmax

BLOCK_H = 16  # query heads per program (tl.dot's smallest side): TP ranks with fewer are masked


def _block_n(rank: int) -> int:
    return 32 if rank <= 256 else 16  # keys per step: a [BLOCK_N, rank] latent block per load


@triton.jit
def _latent_decode_kernel(
    q_ptr, kv_ptr, mid_o, mid_lse, req_to_token, rows, seq_lens, sm_scale, stride_qt, stride_qh, stride_kt,
    stride_r, heads, rank: tl.constexpr, rope: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    b, hb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(rows + b).to(tl.int64)
    seq = tl.load(seq_lens + b)
    per_split = tl.cdiv(seq, SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_ok, r_ok, p_ok = offs_h < heads, offs_r < rank, offs_p < rope
    q_row = q_ptr + b * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + rank + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        slots = tl.load(req_to_token + row * stride_r + offs_n, mask=n_ok, other=0).to(tl.int64)
        kv_row = kv_ptr + slots[:, None] * stride_kt
        c = tl.load(kv_row + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(kv_row + rank + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        s = (_dot(q_nope, tl.trans(c), IEEE) + _dot(q_pe, tl.trans(k_pe), IEEE)) * sm_scale
        m_i, l_i, acc = _online_softmax(tl.where(n_ok[None, :], s, float("-inf")), c, m_i, l_i, acc, IEEE)
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    base = (b * heads + offs_h) * SPLITS + split  # mid_* are [B, heads, SPLITS(, rank)]
    tl.store(mid_o + base[:, None] * rank + offs_r[None, :], out, mask=h_ok[:, None] & r_ok[None, :])
    tl.store(mid_lse + base, lse, mask=h_ok)


def latent_decode(q, kv_buf, out, req_to_token, meta, scale: float, splits: int) -> None:
    """One query per request: q [B, H, rank + rope] (the pool's dtype), kv_buf [slots, 1, rank + rope]
    (one layer's latents), out [B, H, rank]; `meta` holds rows and seq_lens (device [B]), as the GQA
    decode's; `splits` (a power of two) parts per sequence."""
    batch, heads, width = q.shape
    rank = out.shape[2]
    rope = width - rank
    if q.stride(2) != 1 or kv_buf.stride(2) != 1:
        raise ValueError("latent_decode wants the last dimension of q and the pool contiguous")
    mid_o = torch.empty(batch, heads, splits, rank, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    with _launches:
        _latent_decode_kernel[(batch, triton.cdiv(heads, BLOCK_H), splits)](
            q, kv_buf, mid_o, mid_lse, req_to_token, meta.rows, meta.seq_lens, scale, q.stride(0), q.stride(1),
            kv_buf.stride(0), req_to_token.stride(0), heads, rank=rank, rope=rope, SPLITS=splits,
            IEEE=q.dtype == torch.float32, BLOCK_H=BLOCK_H, BLOCK_N=_block_n(rank), BLOCK_R=_block_d(rank),
            BLOCK_P=_block_d(rope),
        )  # fmt: skip
        _merge_splits[(batch, heads)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), head_dim=rank, SPLITS=splits, BLOCK_D=_block_d(rank)
        )
