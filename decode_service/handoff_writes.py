"""Stream work that lands a handoff in the decode pools: KV chunks as they arrive, then the prebuilt
writes (req_to_token row, KV carried in the record, FutureMap seeds). Submitted on the forward
stream, so it is ordered after every forward that could still read the slots (invariant 7).
"""

from __future__ import annotations

import torch

from common.engine.handoff import Handoff
from common.engine.host_copy import to_device


def write_kv_chunk(pool, kv_slots: torch.Tensor, token_start: int, layer_start: int, k, v) -> None:
    """Write one chunk (K and V [layers, tokens, kv_heads, head_dim]) into `pool` (the target's KV
    pool, or the EAGLE head's) at the request's slots."""
    loc = to_device(kv_slots[token_start : token_start + k.shape[1]], pool.device)
    pool.write_layers(layer_start, loc, k, v)


def submit_kv_chunk(stream, pool, kv_slots: torch.Tensor, token_start: int, layer_start: int, k, v, done=None) -> None:
    """write_kv_chunk on the stream; `done()` is called once the stream has taken the write (the
    sender's flow-control window)."""

    def write():
        write_kv_chunk(pool, kv_slots, token_start, layer_start, k, v)
        if done is not None:
            done()

    stream.submit(write)


def write_prebuilt(runner, fm, req_pool_idx: int, kv_slots: torch.Tensor, handoff: Handoff) -> None:
    """Map the row, write KV carried in the record (target, and the head's with EAGLE), and seed the
    FutureMap row: the first token, and with EAGLE the draft seed and the seq_lens (prompt length)."""
    runner.req_to_token_pool.write(req_pool_idx, 0, kv_slots)
    loc = to_device(kv_slots[: handoff.prompt_len], runner.device)
    if handoff.k is not None:
        runner.kv_pool.write_layers(0, loc, handoff.k, handoff.v)
    dev_row = to_device(torch.tensor([req_pool_idx], dtype=torch.int64), fm.device)
    fm.reset_rows(dev_row)
    fm.stash_tokens(dev_row, to_device(torch.tensor([handoff.first_token], dtype=torch.int64), fm.device))
    if runner.draft is not None:
        if handoff.draft_k is not None:
            runner.draft.kv_pool.write_layers(0, loc, handoff.draft_k, handoff.draft_v)
        fm.stash_draft(
            dev_row,
            to_device(handoff.draft_topk_ids[:1], fm.device),
            to_device(handoff.draft_hidden[None], fm.device, fm.draft_hidden.dtype),
        )
        fm.seed_seq_lens(dev_row, torch.tensor([handoff.prompt_len]))  # seed_seq_lens moves it


def submit_prebuilt(stream, runner, fm, req_pool_idx: int, kv_slots: torch.Tensor, handoff: Handoff) -> None:
    """write_prebuilt on the stream."""
    stream.submit(lambda: write_prebuilt(runner, fm, req_pool_idx, kv_slots, handoff))
