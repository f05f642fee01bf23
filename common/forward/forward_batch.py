"""ForwardBatch: everything one forward reads (and may mutate), built from per-request facts.

Two modes share one layout. EXTEND runs `extend_lens[i]` new tokens of request i on top of
`prefix_lens[i]` tokens whose KV is already in the pool (prefill, and chunked prefill that continues
a prompt). DECODE runs one new token per request (prefix = committed length). In both,
`seq_lens[i] = prefix_lens[i] + extend_lens[i]` is the KV length attention sees after this forward
writes its tokens, and `out_cache_loc` are the KV slots those tokens are written to, read from the
request's ReqToTokenPool row (its KV slots are reserved before the forward is built).

A TREE forward (EAGLE tree drafting and verify, `ForwardBatch.tree`) is an EXTEND whose queries see
the prefix plus a block of E positions after it through `tree_mask` [B, Q, E] instead of causally
(each node sees its ancestors and itself); its tokens sit at explicit block offsets and positions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from common.forward.host_copy import to_device


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64: KV length after this forward
    out_cache_loc: torch.Tensor  # [T] int64: KV slots written by this forward
    logits_indices: torch.Tensor  # rows of the hidden states that get logits (last token of each req)
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_pool_indices_cpu: list[int]  # host copy, so backends need no device sync
    tree_mask: torch.Tensor | None = None  # TREE: [B, Q, E] bool, query i may see block position j
    fixed_extend: int = 0  # EXTEND of this many tokens per request, the last of seq_lens (extend_fixed, trees)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def seq_lens_cpu(self) -> list[int]:
        """KV length each request's queries can see (prefix + new tokens, or prefix + the tree block)."""
        block = self.tree_mask.shape[2] if self.tree_mask is not None else None
        return [p + (block if block is not None else e) for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu)]

    @classmethod
    def tree(
        cls,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        req_pool_indices_cpu: list[int],
        prefix_lens: list[int],
        input_ids: torch.Tensor,
        depths: torch.Tensor,
        offsets: list[int],
        tree_mask: torch.Tensor,
    ) -> ForwardBatch:
        """Q = len(offsets) tokens per request written at block positions prefix + offsets, each at
        position prefix + depth (`depths` [B, Q], device); query i attends to the prefix and to the
        block positions j where tree_mask[b, i, j] ([B, Q, E]). Every token gets logits. A tree whose
        tokens fill the last Q block positions in order (a verify: E = Q; a draft step: E = depth * Q)
        is also a fixed extend of Q (`fixed_extend`): its KV length is the prefix + E."""
        device = req_to_token.device
        batch, q = len(prefix_lens), len(offsets)
        prefix = torch.tensor(prefix_lens, dtype=torch.int64)
        rows = to_device(torch.tensor(req_pool_indices_cpu).repeat_interleave(q), device)
        write_pos = to_device((prefix[:, None] + torch.tensor(offsets)[None, :]).flatten(), device)
        return cls(
            mode=ForwardMode.EXTEND,
            input_ids=input_ids.to(device, torch.int64),
            positions=(to_device(prefix, device)[:, None] + to_device(depths, device)).flatten(),
            req_pool_indices=req_pool_indices.to(device, torch.int64),
            seq_lens=to_device(prefix + tree_mask.shape[2], device),
            out_cache_loc=req_to_token[rows, write_pos].to(torch.int64),
            logits_indices=torch.arange(batch * q, device=device),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=[q] * batch,
            req_pool_indices_cpu=list(req_pool_indices_cpu),
            tree_mask=to_device(tree_mask, device),
            fixed_extend=q if list(offsets) == list(range(tree_mask.shape[2] - q, tree_mask.shape[2])) else 0,
        )

    @classmethod
    def extend(
        cls,
        req_to_token: torch.Tensor,
        req_pool_indices: list[int],
        prefix_lens: list[int],
        token_ids: list[list[int]],
        all_logits: bool = False,
    ) -> ForwardBatch:
        """Extend each request's KV from prefix_lens[i] by token_ids[i] (at least one token each)."""
        device = req_to_token.device
        if any(len(t) == 0 for t in token_ids):
            raise ValueError("every request in an extend batch needs at least one token")
        extend_lens = [len(t) for t in token_ids]
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens)])
        rows = torch.repeat_interleave(torch.tensor(req_pool_indices), torch.tensor(extend_lens))
        out_cache_loc = req_to_token[rows.to(device), positions.to(device)].to(torch.int64)
        ends = torch.cumsum(torch.tensor(extend_lens), 0)
        logits_indices = torch.arange(int(ends[-1])) if all_logits else ends - 1
        return cls(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor([t for ts in token_ids for t in ts], dtype=torch.int64, device=device),
            positions=positions.to(device),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64, device=device),
            seq_lens=torch.tensor([p + n for p, n in zip(prefix_lens, extend_lens)], dtype=torch.int64, device=device),
            out_cache_loc=out_cache_loc,
            logits_indices=logits_indices.to(device),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=extend_lens,
            req_pool_indices_cpu=list(req_pool_indices),
        )

    @classmethod
    def extend_fixed(
        cls,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        req_pool_indices_cpu: list[int],
        prefix_lens: list[int],
        input_ids: torch.Tensor,
        length: int,
    ) -> ForwardBatch:
        """`length` new tokens per request on top of prefix_lens[i] (EAGLE's verify and draft extend):
        `input_ids` [B * length] may be a device tensor made by the forward itself (no host sync);
        every token gets logits."""
        device = req_to_token.device
        positions = to_device((torch.tensor(prefix_lens)[:, None] + torch.arange(length)[None, :]).flatten(), device)
        rows = to_device(torch.tensor(req_pool_indices_cpu).repeat_interleave(length), device)
        batch = len(prefix_lens)
        return cls(
            mode=ForwardMode.EXTEND,
            input_ids=input_ids.to(device, torch.int64),
            positions=positions,
            req_pool_indices=req_pool_indices.to(device, torch.int64),
            seq_lens=to_device([p + length for p in prefix_lens], device, torch.int64),
            out_cache_loc=req_to_token[rows, positions].to(torch.int64),
            logits_indices=torch.arange(batch * length, device=device),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=[length] * batch,
            req_pool_indices_cpu=list(req_pool_indices_cpu),
            fixed_extend=length,
        )

    @classmethod
    def decode(
        cls,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: list[int],
        input_ids: torch.Tensor,
        prefix_lens_device: torch.Tensor | None = None,
        req_pool_indices_cpu: list[int] | None = None,
    ) -> ForwardBatch:
        """One new token per request at position = its committed KV length (`prefix_lens`, and its
        device mirror `prefix_lens_device` if the caller has one, e.g. the scheduler's
        kv_committed_lens; it is only read: `positions` is a copy, so nothing the forward does can
        reach the caller's tensor). `seq_lens` is then prefix + 1. `input_ids` may be a device tensor
        produced by the previous forward (no host sync here).
        """
        device = req_to_token.device
        req_pool_indices = req_pool_indices.to(device, torch.int64)
        prefix = prefix_lens_device if prefix_lens_device is not None else to_device(prefix_lens, device, torch.int64)
        batch = len(prefix_lens)
        return cls(
            mode=ForwardMode.DECODE,
            input_ids=input_ids.to(device, torch.int64),
            positions=prefix.clone(),
            req_pool_indices=req_pool_indices,
            seq_lens=prefix + 1,
            out_cache_loc=req_to_token[req_pool_indices, prefix].to(torch.int64),
            logits_indices=torch.arange(batch, device=device),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=[1] * batch,
            req_pool_indices_cpu=req_pool_indices_cpu
            if req_pool_indices_cpu is not None
            else req_pool_indices.tolist(),
        )
