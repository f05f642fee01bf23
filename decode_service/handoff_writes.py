"""Stream work that lands a handoff in the decode pools: KV chunks as they arrive, then the prebuilt
writes (req_to_token row, KV carried in the record, FutureMap seeds). Submitted on the forward
stream, so it is ordered after every forward that could still read the slots (invariant 7).
The `submit_*` functions check what a prefill replica sent against the pools first (on the caller's
thread), so a malformed reply raises ValueError there, for its request alone, and never fails the
stream (which would stop every request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.handoff import Handoff
from common.forward.host_copy import to_device


def write_kv_chunk(pool, kv_slots: torch.Tensor, token_start: int, layer_start: int, k, v) -> None:
    """Write one chunk (K and V [layers, tokens, kv_heads, head_dim]) into `pool` (the target's KV
    pool, or the EAGLE head's) at the request's slots."""
    loc = to_device(kv_slots[token_start : token_start + k.shape[1]], pool.device)
    pool.write_layers(layer_start, loc, k, v)


def check_kv(pool, num_slots: int, token_start: int, layer_start: int, k, v) -> None:
    """Raise ValueError unless K and V ([layers, tokens, kv_heads, head_dim] each, floating; V's width the
    pool's own) fit `pool` at positions token_start.. of a reservation of `num_slots` slots."""
    for name, t, whole in (("K", k, pool.k_all), ("V", v, pool.v_all)):
        per_slot = tuple(whole.shape[2:])
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[2:]) != per_slot:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"KV chunk's {name} is {got}, expected [layers, tokens, {per_slot[0]}, {per_slot[1]}]")
        if not t.dtype.is_floating_point:
            raise ValueError(f"KV chunk's {name} is {t.dtype}, expected a floating dtype")
    layers, tokens = k.shape[0], k.shape[1]
    if k.shape[:2] != v.shape[:2] or not layers or not tokens:
        raise ValueError(f"KV chunk with K {tuple(k.shape)} and V {tuple(v.shape)}: empty or unequal")
    if token_start < 0 or layer_start < 0 or token_start + tokens > num_slots or layer_start + layers > pool.num_layers:
        raise ValueError(
            f"KV chunk out of range: tokens {token_start}+{tokens} of {num_slots}, layers {layer_start}+{layers} "
            f"of {pool.num_layers}"
        )


def submit_kv_chunk(stream, pool, kv_slots: torch.Tensor, token_start: int, layer_start: int, k, v, done=None) -> None:
    """write_kv_chunk on the stream, once checked (check_kv: ValueError, nothing submitted); `done()` is
    called once the stream has taken the write (the sender's flow-control window)."""
    check_kv(pool, len(kv_slots), token_start, layer_start, k, v)

    def write():
        write_kv_chunk(pool, kv_slots, token_start, layer_start, k, v)
        if done is not None:
            done()

    stream.submit(write)


@dataclass
class ForkSeed:
    """Decode's own record for a forked sample of an n > 1 request under EAGLE (sample_group.py), beside
    its Handoff: its slot at the last prompt position takes the target KV of slot `last_from` (the
    prompt's, written by sample 0's handoff) and the head's K / V `draft_k` / `draft_v` [kv_heads, head_dim]."""

    last_from: int
    draft_k: torch.Tensor
    draft_v: torch.Tensor


def write_prebuilt(
    runner, fm, req_pool_idx: int, kv_slots: torch.Tensor, handoff: Handoff, fork: ForkSeed | None = None
) -> None:
    """Map the row, write KV carried in the record (target, and the head's with EAGLE), and seed the
    FutureMap row: the first token, and with EAGLE the draft seed and the committed length (the prompt's);
    a forked sample's own last prompt slot from `fork`."""
    runner.req_to_token_pool.write(req_pool_idx, 0, kv_slots)
    loc = to_device(kv_slots[handoff.kv_start : handoff.prompt_len], runner.device)  # decode's cache holds the rest
    if handoff.k is not None:
        runner.kv_pool.write_layers(0, loc, handoff.k, handoff.v)
    dev_row = to_device(torch.tensor([req_pool_idx], dtype=torch.int64), fm.device)
    fm.reset_rows(dev_row)
    fm.stash_tokens(dev_row, to_device(torch.tensor([handoff.first_token], dtype=torch.int64), fm.device))
    if fm.penalties is not None and handoff.params.processed:  # the first token counts when a step reads it
        resent = handoff.prompt_ids[handoff.prompt_len - handoff.first_position :]
        fm.penalties.seed(req_pool_idx, handoff.prompt_ids[: handoff.prompt_len - handoff.first_position], resent)
    if runner.draft is not None:
        if handoff.draft_k is not None:
            runner.draft.kv_pool.write_layers(0, loc, handoff.draft_k, handoff.draft_v)
        fm.stash_draft(
            dev_row,
            to_device(handoff.draft_topk_ids[:1], fm.device),
            to_device(handoff.draft_hidden[None], fm.device, fm.draft_hidden.dtype),
        )
        fm.seed_kv_committed_lens(dev_row, torch.tensor([handoff.prompt_len]))  # a host value: the seed moves it
        if fork is not None:  # n > 1: a forked sample's own slot at the last prompt position
            write_fork_last(runner, fork, loc[-1:])


def write_fork_last(runner, fork: ForkSeed, last: torch.Tensor) -> None:
    """A forked sample's slot `last` at the last prompt position: the target KV there is the prompt's
    (copied from `fork.last_from` in every layer), the head's KV its own (from the record)."""
    src = to_device([fork.last_from], runner.device, torch.int64)
    for whole in (runner.kv_pool.k_all, runner.kv_pool.v_all):
        whole.index_copy_(1, last, whole.index_select(1, src))
    runner.draft.kv_pool.write_layers(0, last, fork.draft_k[None, None], fork.draft_v[None, None])


def check_prebuilt(runner, fm, kv_slots: torch.Tensor, handoff: Handoff, fork: ForkSeed | None = None) -> None:
    """Raise ValueError unless what write_prebuilt writes fits: KV in the record (per layer [prompt_len,
    kv_heads, head_dim]) and, with EAGLE, the seed's width (Handoff.check_draft checks its values)."""
    n = handoff.prompt_len
    if n > len(kv_slots):
        raise ValueError(f"handoff {handoff.rid}: {n} prompt tokens, {len(kv_slots)} slots reserved")
    kvs = [(runner.kv_pool, handoff.k, handoff.v)]
    if runner.draft is not None:
        kvs.append((runner.draft.kv_pool, handoff.draft_k, handoff.draft_v))
        if handoff.draft_hidden is None or tuple(handoff.draft_hidden.shape) != tuple(fm.draft_hidden.shape[1:]):
            raise ValueError(f"handoff {handoff.rid}: draft hidden does not match the head's width")
        check_sample_drafts(runner.draft.kv_pool, handoff, fork)
    for pool, k, v in kvs:
        if k is None:
            continue
        if len(k) != pool.num_layers or len(v) != pool.num_layers:
            raise ValueError(f"handoff {handoff.rid}: KV for {len(k)}/{len(v)} layers, expected {pool.num_layers}")
        for layer_k, layer_v in zip(k, v):
            check_kv(pool, n, 0, 0, layer_k[None], layer_v[None])
            if layer_k.shape[0] != handoff.kv_len:
                raise ValueError(f"handoff {handoff.rid}: KV of {layer_k.shape[0]} tokens, expected {handoff.kv_len}")


def check_sample_drafts(pool, handoff: Handoff, fork: ForkSeed | None = None) -> None:
    """Raise ValueError unless the head KV rows for the samples' last prompt position (n > 1: samples
    1..n-1's in the record, or a forked sample's own) fit the head's pool, floating."""
    rows = handoff.params.n - 1 if handoff.more_draft_k is not None else 0
    kvs = [(handoff.more_draft_k, handoff.more_draft_v, (rows,))] if rows else []
    if fork is not None:
        kvs.append((fork.draft_k, fork.draft_v, ()))
    for k, v, lead in kvs:
        for name, t, whole in (("K", k, pool.k_all), ("V", v, pool.v_all)):
            want = (*lead, *whole.shape[2:])
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or not t.dtype.is_floating_point:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"handoff {handoff.rid}: the samples' head {name} at the last position is {got}, expected {want}"
                )


def submit_prebuilt(
    stream, runner, fm, req_pool_idx: int, kv_slots: torch.Tensor, handoff: Handoff, fork: ForkSeed | None = None
) -> None:
    """write_prebuilt on the stream, once checked (check_prebuilt: ValueError, nothing submitted)."""
    check_prebuilt(runner, fm, kv_slots, handoff, fork)
    stream.submit(lambda: write_prebuilt(runner, fm, req_pool_idx, kv_slots, handoff, fork))
