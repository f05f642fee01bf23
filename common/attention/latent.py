"""Attention over a latent KV pool (MLA, absorbed), in plain torch: works with every backend's pool.

The pool (common/engine/kv_pool.py) holds per layer one latent "head" per slot, [slots + 1, 1, D]
with D = kv_lora_rank + qk_rope_head_dim, and a V of width 0. `latent_attention` writes this
forward's latents at `out_cache_loc`, then, per request, scores its queries [n, H, D] against the
latents of its KV slots (found through its ReqToTokenPool row), causally (or through a tree mask),
and returns the probability-weighted sum of the latents' first `v_dim` columns: [T, H, v_dim]. One
key and one value row serve every head (multi-query), so nothing per head is read or built.
Scores and softmax are in fp32. A per-request loop: clear first; a batched or paged kernel can sit
behind the same call later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.forward.forward_batch import ForwardBatch


def latent_attention(
    backend, q: torch.Tensor, latent: torch.Tensor, v_dim: int, layer: int, forward_batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """q [T, H, D], latent [T, 1, D] (this forward's tokens) -> [T, H, v_dim]."""
    pool, table = backend.kv_pool, backend.req_to_token_pool.req_to_token
    buf = pool.k[layer]
    buf.index_copy_(0, forward_batch.out_cache_loc, latent.to(buf.dtype))
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    start, tree = 0, forward_batch.tree_mask
    rows, seq = forward_batch.req_pool_indices_cpu, forward_batch.seq_lens_cpu
    for b, (row, s, prefix, n) in enumerate(
        zip(rows, seq, forward_batch.prefix_lens_cpu, forward_batch.extend_lens_cpu)
    ):
        keys = buf.index_select(0, table[row, :s].to(torch.int64))[:, 0].float()  # [S, D]
        scores = torch.einsum("qhd,kd->hqk", q[start : start + n].float(), keys) * scale
        q_pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
        k_pos = torch.arange(s, device=q.device)[None, :]
        if tree is None:
            hidden = k_pos > q_pos
        else:  # the prefix, then the tree block through tree_mask
            hidden = (k_pos >= prefix) & ~F.pad(tree[b], (prefix, 0), value=True)
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
        out[start : start + n] = torch.einsum("hqk,kv->qhv", probs, keys[:, :v_dim]).to(q.dtype)
        start += n
    return out
