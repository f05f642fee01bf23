"""Reference attention in plain torch: works on CPU and CUDA, reads K/V through req_to_token.

Per request: gather K/V of positions 0..seq_len-1 from the pool through the request's row, then
softmax(q k^T * scale) v with a causal mask offset by the prefix length. Clear rather than fast;
the Triton backend will sit behind the same interface.
"""

from __future__ import annotations

import torch

from common.attention.base import AttentionBackend
from common.forward.forward_batch import ForwardBatch


class TorchReferenceBackend(AttentionBackend):
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        rows = forward_batch.req_pool_indices_cpu
        table = self.req_to_token_pool.req_to_token
        self._kv_slots = [table[r, :n].to(torch.int64) for r, n in zip(rows, forward_batch.seq_lens_cpu)]

    def forward(self, q, k, v, layer, forward_batch, scale):
        self.kv_pool.write(layer, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.k[layer], self.kv_pool.v[layer]
        group = q.shape[1] // k_buf.shape[1]
        out = torch.empty_like(q)
        start, tree = 0, forward_batch.tree_mask
        for b, (slots, prefix, n) in enumerate(
            zip(self._kv_slots, forward_batch.prefix_lens_cpu, forward_batch.extend_lens_cpu)
        ):
            keys = k_buf[slots].to(q.dtype).repeat_interleave(group, dim=1)  # [S, heads, d]
            values = v_buf[slots].to(q.dtype).repeat_interleave(group, dim=1)
            query = q[start : start + n]  # [n, heads, d]
            scores = torch.einsum("qhd,khd->hqk", query.float(), keys.float()) * scale
            q_pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
            k_pos = torch.arange(slots.numel(), device=q.device)[None, :]
            if tree is None:
                hidden = k_pos > q_pos
            else:  # the prefix, then the tree block through tree_mask
                hidden = (k_pos >= prefix) & ~torch.nn.functional.pad(tree[b], (prefix, 0), value=True)
            scores.masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
            start += n
        return out
