"""Triton attention backend (`--attention-backend triton`): paged kernels, no padded K/V copy.

`init_forward_metadata` (once per forward, from the ForwardBatch's host lists; no device sync)
puts rows, prefix and new-token counts, packed query starts and visible KV lengths on the device,
and picks the decode split count from the longest sequence. `forward` writes this forward's K/V
into the pool and runs `common/attention/triton_kernels.py`: the decode kernel for a DECODE batch
(one token per request), the extend kernel (causal, or through the tree mask) otherwise. MLA's
layers call `latent_attention`: the latent decode kernel (common/attention/triton_latent.py) for a
DECODE batch, the torch loop over the latent pool (common/attention/latent.py) otherwise.

On a CUDA device the kernels compile; on CPU they need Triton's interpreter (`TRITON_INTERPRET=1`
before Triton loads), which is slow and meant for tests: the backend says so rather than fail
inside a launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from common.attention.base import AttentionBackend
from common.attention.latent import latent_attention
from common.forward.forward_batch import ForwardBatch, ForwardMode
from common.forward.host_copy import to_device

SPLIT_TOKENS = 256  # decode: one split per this many keys of the longest sequence ...
MAX_SPLITS = 16  # ... up to this many (a power of two; each split writes a partial result)


@dataclass
class KernelMeta:
    batch: int
    max_extend: int
    rows: torch.Tensor  # [B] req_to_token rows
    seq_lens: torch.Tensor  # [B] KV length each request's queries see
    prefix_lens: torch.Tensor | None = None  # extend only: [B]
    extend_lens: torch.Tensor | None = None
    q_starts: torch.Tensor | None = None  # [B] first packed query of each request


def decode_splits(max_seq: int) -> int:
    """Parts per sequence for split-K decode: a power of two, more for longer sequences."""
    want = min(MAX_SPLITS, max(1, -(-max_seq // SPLIT_TOKENS)))
    return 1 << (want - 1).bit_length()


def check_usable(device: torch.device) -> None:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ValueError("--attention-backend triton needs the triton package (pip install triton)") from e
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--attention-backend triton on CPU runs only under Triton's interpreter (set TRITON_INTERPRET=1; "
            "slow, for tests): use batched on CPU"
        )


class TritonBackend(AttentionBackend):
    supports_cuda_graph = (
        True  # decode, fixed-extend and verify-tree metadata from device tensors only (cuda_graph_runner.py)
    )
    fixed_decode_splits = False  # set while a graph is captured: the split count for the longest context
    cuda_fused = None  # the fused CUDA ops (common/models/cuda_fused.py): rotary + KV write as one kernel

    @property
    def fused_decode_now(self) -> bool:
        """Attention.forward hands qkv_proj's output to `fused_decode` (every mode, not only decode)."""
        return self.cuda_fused is not None

    def __init__(self, kv_pool, req_to_token_pool):
        super().__init__(kv_pool, req_to_token_pool)
        check_usable(kv_pool.k[0].device)
        from common.attention import triton_kernels, triton_latent  # Triton loads only when this backend is chosen

        self._kernels, self._latent = triton_kernels, triton_latent

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        device = self.req_to_token_pool.req_to_token.device
        seq = forward_batch.seq_lens_cpu
        extend = forward_batch.extend_lens_cpu
        self._decode = forward_batch.mode == ForwardMode.DECODE and forward_batch.tree_mask is None
        if self._decode:  # the batch's own device tensors: nothing from the host, so a graph can replay it
            meta = KernelMeta(len(seq), 1, forward_batch.req_pool_indices, forward_batch.seq_lens)
            longest = self.req_to_token_pool.req_to_token.shape[1] if self.fixed_decode_splits else max(seq)
            self._splits = decode_splits(longest)
        elif forward_batch.fixed_extend:  # a chain's verify, a tree's verify (with its mask), a draft extend
            meta = self._fixed_extend_meta(forward_batch)
        else:
            meta = KernelMeta(
                batch=len(seq),
                max_extend=max(extend),
                rows=to_device(forward_batch.req_pool_indices_cpu, device, torch.int64),
                seq_lens=to_device(seq, device, torch.int32),
            )
            starts, total = [], 0
            for n in extend:
                starts.append(total)
                total += n
            meta.prefix_lens = to_device(forward_batch.prefix_lens_cpu, device, torch.int32)
            meta.extend_lens = to_device(extend, device, torch.int32)
            meta.q_starts = to_device(starts, device, torch.int32)
        tree = forward_batch.tree_mask
        self._tree = None if tree is None else tree.contiguous().view(torch.int8)
        self._meta = meta

    @staticmethod
    def _fixed_extend_meta(fb: ForwardBatch) -> KernelMeta:
        """L tokens per request after its committed KV (EAGLE's verify, draft extend; a tree's L nodes
        end a block of E positions, so the prefix is seq_lens - E), from the batch's device tensors
        only: a captured graph replays it with new lengths."""
        length, seq = fb.fixed_extend, fb.seq_lens.to(torch.int32)
        block = length if fb.tree_mask is None else fb.tree_mask.shape[2]
        starts = torch.arange(fb.batch_size, device=seq.device, dtype=torch.int32) * length
        return KernelMeta(
            fb.batch_size, length, fb.req_pool_indices, seq, seq - block, torch.full_like(seq, length), starts
        )

    def forward(self, q, k, v, layer, forward_batch, scale):
        self.kv_pool.write(layer, forward_batch.out_cache_loc, k, v)
        return self._attend(q, layer, scale)

    def fused_decode(self, qkv, cos, sin, attn, forward_batch) -> torch.Tensor:
        """`forward` from qkv_proj's output [T, (heads + 2 kv_heads) * d]: q/k norm (Qwen3), rotary and the
        K/V write as one kernel (cuda_fused.rotary_kv), then the attention kernels -> [T, heads * d]."""
        layer = attn.layer
        k_buf, v_buf = self.kv_pool.k[layer], self.kv_pool.v[layer]
        q = self.cuda_fused.rotary_kv(qkv, cos, sin, attn, k_buf, v_buf, forward_batch.out_cache_loc)
        return self._attend(q, layer, attn.scale).reshape(q.shape[0], -1)

    def _attend(self, q, layer, scale):
        """Attention of q [T, heads, d] over the pool (this forward's K/V already written)."""
        k_buf, v_buf = self.kv_pool.k[layer], self.kv_pool.v[layer]
        table = self.req_to_token_pool.req_to_token
        q = q.to(k_buf.dtype) if q.dtype != k_buf.dtype else q
        out = torch.empty_like(q)
        if self._decode:
            self._kernels.decode_attention(q, k_buf, v_buf, out, table, self._meta, scale, self._splits)
        else:
            self._kernels.extend_attention(q, k_buf, v_buf, out, table, self._meta, scale, self._tree)
        return out

    def latent_attention(self, q, latent, v_dim, layer, forward_batch, scale):
        """MLA, absorbed (common/models/mla.py): q [T, H, D], latent [T, 1, D] -> [T, H, v_dim], as
        common/attention/latent.py's `latent_attention`, through the latent decode kernel when this
        forward is a DECODE batch (metadata from device tensors: no host sync)."""
        if not self._decode:  # extend, verify, tree: the torch loop over the latent pool
            return latent_attention(self, q, latent, v_dim, layer, forward_batch, scale)
        buf = self.kv_pool.k[layer]
        buf.index_copy_(0, forward_batch.out_cache_loc, latent.to(buf.dtype))
        out = q.new_empty(q.shape[0], q.shape[1], v_dim)
        q = q.to(buf.dtype) if q.dtype != buf.dtype else q
        self._latent.latent_decode(
            q.contiguous(), buf, out, self.req_to_token_pool.req_to_token, self._meta, scale, self._splits
        )
        return out
