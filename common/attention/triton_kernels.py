"""Paged attention kernels in Triton: K/V read in place through req_to_token, no padded copy.

Two kernels and a reduction, all online-softmax (running max, running sum, fp32 accumulator):
- `extend_attention`: the queries of an extend (prefill chunk on top of a prefix, EAGLE draft extend,
  verify) or a tree forward. One program per (request, head, block of queries); it walks the
  request's KV in blocks of slots read from its req_to_token row. Key j is visible to query i
  (position prefix + i) when j < prefix, or, inside the new block, causally (j <= prefix + i) or
  through the tree mask. The walk stops at the block's last visible key.
- `decode_attention`: one query per request. One program per (request, KV head, split): the query
  heads of a GQA group share each K/V load (no expansion), and each split walks one part of the
  sequence (split-K), writing a partial output and its log-sum-exp; `_merge_splits` combines them.
Head sizes need not be powers of two (masked). All kernels run under the Triton interpreter
(`TRITON_INTERPRET=1`) on CPU tensors, which is how the tests prove them against the torch
reference without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # keys per step of the walk
BLOCK_M = 32  # queries per extend program
MIN_DOT = 16  # tl.dot wants every side >= 16: small GQA groups are padded up to it
# The interpreter patches triton.language process-wide for the length of a launch, so two threads
# launching at once (a decode stream beside an in-process prefill) break each other: one at a time.
_launches = threading.Lock() if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext()


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in fp32; fp32 inputs exactly (`ieee`), not through TF32 as Triton's default would on a GPU."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee").to(tl.float32)
    return tl.dot(a, b).to(tl.float32)


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one block of scores s [M, N] (-inf where hidden) and values v [N, D] into the running
    max m_i, sum l_i and fp32 accumulator acc; returns the three updated."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, req_to_token, rows, prefix_lens, extend_lens, q_starts, seq_lens, tree_mask,
    sm_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_r,
    stride_tb, stride_tq, group: tl.constexpr, head_dim: tl.constexpr, IS_TREE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b, h, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_new = tl.load(extend_lens + b)
    if mb * BLOCK_M < n_new:
        row = tl.load(rows + b).to(tl.int64)
        prefix = tl.load(prefix_lens + b)
        seq = tl.load(seq_lens + b)
        q_start = tl.load(q_starts + b).to(tl.int64)
        kv_h = h // group
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok, d_ok = offs_m < n_new, offs_d < head_dim
        q = tl.load(
            q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = seq
        if not IS_TREE:  # causal: no key past the block's last query
            end = tl.minimum(seq, prefix + (mb + 1) * BLOCK_M)
        for start in range(0, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            slots = tl.load(req_to_token + row * stride_r + offs_n, mask=n_ok, other=0).to(tl.int64)
            kv_off = slots[:, None] * stride_kt + kv_h * stride_kh + offs_d[None, :]
            k = tl.load(k_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * sm_scale
            if IS_TREE:
                block = offs_n - prefix
                in_block = (block >= 0) & n_ok
                tm = tl.load(
                    tree_mask + b * stride_tb + offs_m[:, None] * stride_tq + block[None, :],
                    mask=m_ok[:, None] & in_block[None, :],
                    other=0,
                )
                visible = (offs_n[None, :] < prefix) | (tm != 0)
            else:
                visible = offs_n[None, :] <= (prefix + offs_m)[:, None]
            visible = visible & n_ok[None, :]
            v = tl.load(v_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax(tl.where(visible, s, float("-inf")), v, m_i, l_i, acc, IEEE)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            o_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, mid_o, mid_lse, req_to_token, rows, seq_lens, sm_scale, stride_qt, stride_qh, stride_kt,
    stride_kh, stride_r, group: tl.constexpr, head_dim: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b, kv_h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(rows + b).to(tl.int64)
    seq = tl.load(seq_lens + b)
    per_split = tl.cdiv(seq, SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok, d_ok = offs_h < group, offs_d < head_dim
    heads = kv_h * group + offs_h
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        slots = tl.load(req_to_token + row * stride_r + offs_n, mask=n_ok, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_kt + kv_h * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = _dot(q, tl.trans(k), IEEE) * sm_scale
        v = tl.load(v_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax(tl.where(n_ok[None, :], s, float("-inf")), v, m_i, l_i, acc, IEEE)
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    base = (b * group * tl.num_programs(1) + heads) * SPLITS + split  # mid_* are [B, heads, SPLITS(, d)]
    tl.store(mid_o + base[:, None] * head_dim + offs_d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(mid_lse + base, lse, mask=h_ok)


@triton.jit
def _merge_splits(
    mid_o, mid_lse, o_ptr, stride_ot, stride_oh, head_dim: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr
):
    b, h = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    base = (b * tl.num_programs(1) + h) * SPLITS
    lse = tl.load(mid_lse + base + offs_s)
    top = tl.max(lse, 0)
    w = tl.exp(lse - top)  # splits that saw no key: exp(-inf) = 0
    parts = tl.load(mid_o + (base + offs_s)[:, None] * head_dim + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def extend_attention(q, k_buf, v_buf, out, req_to_token, meta, scale: float, tree_mask=None) -> None:
    """q/out [T, heads, d] (packed per request), k_buf/v_buf [slots, kv_heads, d]; `meta` holds
    rows, prefix_lens, extend_lens, q_starts, seq_lens (device int tensors [B]) and max_extend."""
    heads, d = q.shape[1], q.shape[2]
    is_tree = tree_mask is not None
    tm = tree_mask if is_tree else q.new_zeros(1, 1, 1, dtype=torch.int8)
    grid = (meta.batch, heads, triton.cdiv(meta.max_extend, BLOCK_M))
    with _launches:
        _extend_kernel[grid](
            q, k_buf, v_buf, out, req_to_token, meta.rows, meta.prefix_lens, meta.extend_lens, meta.q_starts,
            meta.seq_lens, tm, scale, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), out.stride(0),
            out.stride(1), req_to_token.stride(0), tm.stride(0), tm.stride(1), group=heads // k_buf.shape[1],
            head_dim=d, IS_TREE=is_tree, IEEE=q.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_D=_block_d(d),
        )  # fmt: skip


def decode_attention(q, k_buf, v_buf, out, req_to_token, meta, scale: float, splits: int) -> None:
    """One query per request: q/out [B, heads, d]; `splits` (a power of two) parts per sequence."""
    batch, heads, d = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    mid_o = torch.empty(batch, heads, splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    with _launches:
        _decode_kernel[(batch, kv_heads, splits)](
            q, k_buf, v_buf, mid_o, mid_lse, req_to_token, meta.rows, meta.seq_lens, scale, q.stride(0),
            q.stride(1), k_buf.stride(0), k_buf.stride(1), req_to_token.stride(0), group=group, head_dim=d,
            SPLITS=splits, IEEE=q.dtype == torch.float32, BLOCK_H=max(MIN_DOT, triton.next_power_of_2(group)),
            BLOCK_N=BLOCK_N, BLOCK_D=_block_d(d),
        )  # fmt: skip
        _merge_splits[(batch, heads)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), head_dim=d, SPLITS=splits, BLOCK_D=_block_d(d)
        )


def _block_d(d: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(d))
