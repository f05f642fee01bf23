"""Batched attention in plain torch: one scaled_dot_product_attention call per layer for the whole batch.

`init_forward_metadata` (once per forward, from the ForwardBatch's host lists, no device sync)
builds a padded [B, S_max] index of KV slots read from req_to_token (padded lanes -> slot 0, the
padding slot) and a boolean mask [B, 1, Q_max, S_max] = key within the sequence and causal (query
i of request b sits at position prefix_b + i). Ragged extends scatter the packed queries [T, heads, d]
into a padded [B, Q_max, heads, d] buffer and gather the output back with flat index tensors built
there too; decode (Q_max = 1) and equal-length extends are plain views.

Cost model per layer: one index_select of B * S_max KV rows each for k and v (on CPU into a scratch
buffer reused by all layers and forwards, grown to the largest box seen), one SDPA over [B, heads,
Q_max, S_max] (no mask in a decode without padding, else an additive mask built once per forward).
In a decode (Q_max = 1) the query heads that share a kv head become the query rows of one
attention over it (`fold_group`: a view, no copy): one query block per kv head instead of one per
head, each K/V read once. On CPU this halved SDPA's time (64 requests x 165 keys, SmolLM2's 9 heads
over 3: 1.25 -> 0.66 ms per layer). Otherwise on CPU the GQA heads are shared through `enable_gqa`;
elsewhere (and on torch < 2.5) K/V are repeat_interleave'd, since on CUDA `enable_gqa` with a mask
falls back to the math kernel.
Work and memory grow with the padded box B * Q_max * S_max, so very ragged batches waste compute
on padding, but there is no Python loop over requests per layer.
With the fused CPU ops (fp32, common/models/cpu_fused.py) a decode batch, and an extend whose requests'
new tokens see few keys each (`fused_extend_slots`), skip all of that: Attention.forward hands
qkv_proj's output to `fused_decode`, one C++ call per layer that norms and rotates q/k, writes K/V and
attends each token over its request's slots up to its own (no gather, no mask, no padding work).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.attention.base import AttentionBackend
from common.forward import intra_op
from common.forward.forward_batch import ForwardBatch
from common.forward.host_copy import to_device


def _probe_enable_gqa() -> bool:
    try:
        with intra_op.single_threaded():  # at import: start no OpenMP pool on the importing thread
            F.scaled_dot_product_attention(
                torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), enable_gqa=True
            )
        return True
    except (TypeError, RuntimeError):
        return False


_HAS_ENABLE_GQA = _probe_enable_gqa()


def sdpa(q, k, v, mask, scale):
    """q [B, heads, Q, d], k/v [B, kv_heads, S, d], mask [B, 1, Q, S] (bool or additive) or None
    -> [B, heads, Q, d]."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and _HAS_ENABLE_GQA and q.device.type == "cpu":  # CPU flash kernel shares heads itself
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if group > 1:  # torch < 2.5, or CUDA, where enable_gqa with a mask silently takes the math kernel
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def fold_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale) -> torch.Tensor:
    """Decode attention with the heads of each GQA group as query rows: q [B, heads, d] (one query per
    request), k/v [B, kv_heads, S, d], mask [B, 1, 1, S] or None -> [B, heads, d]. Head h reads kv head
    h // group (HF's repeat_kv order), so the view [B, kv_heads, group, d] lines each group up with
    its kv head; every row sees the same keys, so one mask row serves all."""
    batch, heads, d = q.shape
    rows = q.view(batch, k.shape[1], heads // k.shape[1], d)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, d)  # a view where SDPA's output is contiguous (CPU); CUDA's may not be


class BatchedBackend(AttentionBackend):
    _scratch = None  # CPU: [2, rows, kv_heads, d] gathered K/V, reused by every layer, grown as needed
    mask_decodes_up_to = 1  # decodes of 2..N requests get a mask even without padding (torch compile)
    query_dtype = None  # the model's, where the pool's differs (--kv-cache-dtype): the mask's dtype
    fused = None  # CPU fp32: the fused ops (common/models/cpu_fused.py); decode batches go through them
    fused_decode_now = False  # this forward's decode runs as one fused call per layer (`fused_decode`)
    fused_extend_now = False  # so does this forward's extend, where it is short (below)
    # an extend in which each request's new tokens see at most this many key slots in all takes the fused
    # call too (each token's scores one dot per slot; the work grows with each request's slots, SDPA's with
    # its padded box). A SmolLM2 prefill of one request, fused against SDPA (2-core AMD Zen 4, fp32,
    # interleaved): 50 / 128 / 256 / 512 tokens 80.2 / 168.4 / 323.3 / 676.7 ms against 91.2 / 192.0 / 352.9 /
    # 746.1; 1,024 1595.8 / 1674.6 against 1663.2 / 1687.6 in two runs; 2,048 4251.6 against 4379.9
    fused_extend_slots = 2048 * 2049 // 2  # a 2,048-token prompt
    _token_seq = _token_req = None  # per new token of a fused step: the slots it sees, its request (extends)
    _pending = None  # a fused decode's arguments to `_gather_metadata`, until a layer runs the torch path

    def fused_takes_pool(self) -> bool:
        """Whether the fused ops serve this pool: a CPU pool of float32 or bf16 (a float32 model's,
        --kv-cache-dtype)."""
        k0 = self.kv_pool.k[0]
        return self.fused is not None and k0.dtype in (torch.float32, torch.bfloat16) and k0.device.type == "cpu"

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        table = self.req_to_token_pool.req_to_token
        device = table.device
        seq = forward_batch.seq_lens_cpu
        batch, s_max, q_max = len(seq), max(seq), max(forward_batch.extend_lens_cpu)
        seq_t = to_device(seq, device, torch.int64)
        rows = to_device(forward_batch.req_pool_indices_cpu, device, torch.int64)
        self._batch, self._q_max = batch, q_max
        fused = (
            self.fused_takes_pool()
            and forward_batch.tree_mask is None
            and forward_batch.out_cache_loc.dtype == torch.int64
        )
        extend = forward_batch.extend_lens_cpu
        self.fused_decode_now = fused and q_max == 1
        self.fused_extend_now = (  # the key slots each request's new tokens see, within the bound
            fused
            and q_max > 1
            and max(q * (s - q) + q * (q + 1) // 2 for s, q in zip(seq, extend)) <= self.fused_extend_slots
        )
        self._pending = None
        if self.fused_decode_now or self.fused_extend_now:
            # the fused call reads each request's slots up to its length itself: no mask, no gather. The
            # torch path's metadata waits for a layer that asks (`forward`): after a batch-1 step's weights
            # streamed past, each torch op here cost ~30 us of cold caches (2-core AMD Zen 4)
            self._slots_2d = table[rows, :s_max].to(torch.int64)
            self._pending = (forward_batch, seq_t, rows)
            self._token_seq, self._token_req = seq_t, None
            if self.fused_extend_now:  # per new token: the slots it sees (causal) and its request's row
                ends = [s - q + 1 + i for s, q in zip(seq, extend) for i in range(q)]
                self._token_seq = to_device(ends, device, torch.int64)
                self._token_req = to_device([b for b, q in enumerate(extend) for _ in range(q)], device, torch.int64)
            return
        self._gather_metadata(forward_batch, seq_t, rows)

    def _gather_metadata(self, forward_batch: ForwardBatch, seq_t: torch.Tensor, rows: torch.Tensor) -> None:
        """The torch path's metadata: the flat slot list, the mask, the scratch, the packed rows' order."""
        table = self.req_to_token_pool.req_to_token
        device = table.device
        prefix_t = to_device(forward_batch.prefix_lens_cpu, device, torch.int64)
        extend, seq = forward_batch.extend_lens_cpu, forward_batch.seq_lens_cpu
        batch, s_max, q_max = len(seq), max(seq), max(extend)
        k_pos = torch.arange(s_max, device=device)
        in_seq = k_pos[None, :] < seq_t[:, None]  # [B, S]
        self._slots = torch.where(in_seq, table[rows, :s_max], 0).to(torch.int64).view(-1)  # [B*S]
        even = min(seq) == s_max and not 1 < batch <= self.mask_decodes_up_to
        if forward_batch.tree_mask is None and q_max == 1 and even:
            self._mask = None  # decode with no padding (batch 1 always): every key is visible
        else:  # additive, built once here (SDPA would convert a bool mask in every layer)
            allowed = self._allowed(forward_batch, prefix_t, in_seq, k_pos, q_max)
            dtype = self.query_dtype or self.kv_pool.dtype  # the queries' (the pool's may be narrower)
            self._mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        if not self.fused_decode_now:
            self._slots_2d = self._slots.view(batch, s_max)
        k0 = self.kv_pool.k[0]
        # on CPU, faulting in fresh pages each layer costs more than the gather
        if k0.device.type == "cpu" and (self._scratch is None or self._scratch.shape[1] < batch * s_max):
            self._scratch = k0.new_empty((2, batch * s_max) + k0.shape[1:])
        self._flat = None  # None: packed queries are already [B, Q_max] in order
        if any(n != q_max for n in extend):
            lens = torch.tensor(extend)
            first = torch.cumsum(lens, 0) - lens  # packed start of each req
            shift = (torch.arange(batch) * q_max - first).repeat_interleave(lens)  # packed -> padded row
            self._flat = to_device(torch.arange(int(lens.sum())) + shift, device)  # [T]

    @staticmethod
    def _allowed(forward_batch, prefix_t, in_seq, k_pos, q_max) -> torch.Tensor:
        """[B, 1, Q_max, S_max] bool: which keys each query may see."""
        # Query i of request b sits at position prefix_b + i; padded query rows (i >= extend_b) keep
        # key 0 visible so no softmax row is empty (their output is never read).
        if forward_batch.tree_mask is None:
            q_pos = prefix_t[:, None] + torch.arange(q_max, device=k_pos.device)[None, :]  # [B, Q]
            return (in_seq[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None])).unsqueeze(1)
        tree = forward_batch.tree_mask  # the prefix for every query, then the tree block through tree_mask
        block = torch.zeros(len(prefix_t), q_max, len(k_pos), dtype=torch.bool, device=k_pos.device)
        cols = (prefix_t[:, None, None] + torch.arange(tree.shape[2], device=k_pos.device)).expand(-1, q_max, -1)
        block.scatter_(2, cols, tree)
        return ((k_pos[None, None, :] < prefix_t[:, None, None]) | block).unsqueeze(1)

    def fused_decode(self, qkv, cos, sin, attn, forward_batch) -> torch.Tensor:
        """A decode batch's or a short extend's attention from qkv_proj's output [T, (heads + 2 kv_heads) * d]
        in one call: q/k norm (Qwen3), rotary, K/V written at out_cache_loc, each token's attention over its
        request's slots up to its own -> [T, heads * d] (what `forward` and the torch modules around it
        compute)."""
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return self.fused.decode_attention(
            qkv.contiguous(), cos, sin,  # cos / sin [T, 1, d], contiguous
            None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
            q_norm.eps if q_norm is not None else 0.0, *self.fused_pool_args(attn, forward_batch), self._token_req,
        )  # fmt: skip

    def fused_pool_args(self, attn, forward_batch) -> tuple:
        """The fused attention's pool arguments for `attn`'s layer: k_cache, v_cache, out_loc, slots,
        seq_lens, heads, kv_heads, scale (the fused decode layer passes them on too)."""
        return (
            self.kv_pool.k[attn.layer], self.kv_pool.v[attn.layer], forward_batch.out_cache_loc.contiguous(),
            self._slots_2d, self._token_seq, attn.num_heads, attn.num_kv_heads, attn.scale,
        )  # fmt: skip

    def forward(self, q, k, v, layer, forward_batch, scale):
        if self._pending is not None:  # a fused decode step whose layer runs the torch path
            self._gather_metadata(*self._pending)
            self._pending = None
        self.kv_pool.write(layer, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.k[layer], self.kv_pool.v[layer]
        heads, d = q.shape[1], q.shape[2]
        batch, q_max = self._batch, self._q_max
        # index_select on the flat slot list into reused scratch: several times faster than k_buf[slots_2d]
        kv_shape, n = (batch, -1) + k_buf.shape[1:], self._slots.numel()  # [B, S, kv_heads, d]
        if self._scratch is None:
            keys, values = k_buf.index_select(0, self._slots), v_buf.index_select(0, self._slots)
        else:
            keys = torch.index_select(k_buf, 0, self._slots, out=self._scratch[0, :n])
            values = torch.index_select(v_buf, 0, self._slots, out=self._scratch[1, :n])
        keys, values = keys.view(kv_shape), values.view(kv_shape)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        if q_max == 1:  # decode: [B, heads, d] in, the same out
            return fold_group(q, keys, values, self._mask, scale)
        if self._flat is None:
            query = q.reshape(batch, q_max, heads, d)
        else:
            query = q.new_zeros(batch * q_max, heads, d).index_copy_(0, self._flat, q).view(batch, q_max, heads, d)
        out = sdpa(query.transpose(1, 2), keys, values, self._mask, scale)
        out = out.transpose(1, 2).reshape(batch * q_max, heads, d)  # [B*Q_max, heads, d]
        return out if self._flat is None else out.index_select(0, self._flat)
