"""Backend-neutral planning of a handoff's KV writes: where each byte goes, checked once.

Every backend that copies by address (Mooncake, shm) shares this: the decode side names its pools
(`kv_region`: per-layer K and V base addresses and the bytes of one slot) and the request's slots
(`slot_runs`: token i goes to slot slots[i], consecutive slots as one run); the prefill side checks
the destination against its KV (`check_destination`), splits a tensor-parallel destination into
per-rank parts (`rank_parts`: the KV heads each rank holds), verifies decode's signature on every
part (`authorize`, common/wire/kv_capability.py), cuts the KV into chunks whose layers are whole
(`plan_by_layer`) and turns one chunk into (source, destination, length) triples (`write_plan`).
A latent pool (MLA: one latent head per slot, V of width 0) names no V addresses: its region has
K's alone, and only K is written. Under tensor parallelism the latent is a replicated head: every
decode rank holds it whole (`kv_head_start` 0, `kv_head_count` 1), so each rank's part is the same
latent (no copy, no split) written into that rank's pool; prefill reads it from its rank 0 alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from common.wire import kv_capability
from common.wire.proto_gen import prefill_pb2


def slot_runs(slots: list[int]) -> list[prefill_pb2.SlotRun]:
    """Token i -> slots[i], as runs of consecutive slots."""
    runs: list[prefill_pb2.SlotRun] = []
    for i, slot in enumerate(slots):
        last = runs[-1] if runs else None
        if last is not None and last.slot + last.length == slot:
            last.length += 1
        else:
            runs.append(prefill_pb2.SlotRun(token_start=i, slot=slot, length=1))
    return runs


def kv_region(k: list[torch.Tensor], v: list[torch.Tensor]) -> prefill_pb2.KvRegion:
    """A pool's per-layer K and V tensors [num_slots + 1, kv_heads, head_dim] as a destination (a
    latent pool's V, of width 0, has no addresses)."""
    slot_bytes = k[0][0].numel() * k[0].element_size()
    v_ptrs = [t.data_ptr() for t in v] if v[0][0].numel() else []
    return prefill_pb2.KvRegion(k_ptrs=[t.data_ptr() for t in k], v_ptrs=v_ptrs, slot_bytes=slot_bytes)


def check_destination(
    dest: prefill_pb2.KvDestination, region, prompt_len: int, num_layers: int, slot_bytes: int, with_v: bool = True
) -> None:
    """ValueError unless the destination covers every prompt token once and `region` (one of its
    pools) matches the KV's layout (`with_v`: the KV has V bytes; a latent pool's has none)."""
    covered = 0
    for run in dest.runs:
        if run.token_start != covered or run.length == 0:
            raise ValueError("kv_destination runs must cover the prompt's tokens in order")
        covered += run.length
    if covered != prompt_len:
        raise ValueError(f"kv_destination covers {covered} tokens, the prompt has {prompt_len}")
    v_layers = num_layers if with_v else 0
    if len(region.k_ptrs) != num_layers or len(region.v_ptrs) != v_layers or region.slot_bytes != slot_bytes:
        raise ValueError(
            f"kv_destination has {len(region.k_ptrs)} layers of {region.slot_bytes}-byte slots and "
            f"{len(region.v_ptrs)} of V, this model {num_layers} of {slot_bytes} and {v_layers}"
        )


def rank_parts(dest: prefill_pb2.KvDestination, handoff) -> list[tuple]:
    """(session, k, v, region, draft) of every write target: the one destination, or with a
    tensor-parallel decode side each rank with the KV heads it holds (contiguous copies of those
    heads, made where the handoff's KV is; a rank holding every head, as each rank holds MLA's one
    latent head, gets the handoff's own tensors: the same bytes to every rank) and, with EAGLE, the
    head's whole KV into every rank's draft pool."""
    heads = handoff.k[0].shape[1]
    parts = []
    for r in kv_capability.ranks(dest):
        if dest.tp_ranks:
            a, n = r.kv_head_start, r.kv_head_count
            if n == 0 or a + n > heads:
                raise ValueError(f"kv_destination rank holds KV heads [{a}, {a + n}); the model has {heads}")
            whole = n == heads  # a replicated head (the latent), or a rank holding all heads: no copy
            k = handoff.k if whole else [t[:, a : a + n].contiguous() for t in handoff.k]
            v = handoff.v if whole else [t[:, a : a + n].contiguous() for t in handoff.v]
        else:
            k, v = handoff.k, handoff.v
        parts.append((r.session, k, v, r.target, False))
        if handoff.draft_k is not None:
            if not r.HasField("draft"):
                raise ValueError("kv_destination has no draft pool, but this replica runs an EAGLE head")
            parts.append((r.session, handoff.draft_k, handoff.draft_v, r.draft, True))
    return parts


def authorize(writer, dest: prefill_pb2.KvDestination, request_id: str) -> None:
    """CapabilityRefused unless decode signed every target of `dest` for this request. `writer` gives
    each session's key (`capability_key`; None: a writer without a key writes unsigned destinations)
    and remembers what it accepted (`capabilities`, a kv_capability.Verifier)."""
    for rank in kv_capability.ranks(dest):
        key = writer.capability_key(rank.session)
        if key is not None:
            writer.capabilities.check(key, request_id, rank, dest.runs)


def plan_by_layer(
    num_tokens: int, num_layers: int, bytes_per_token_layer: int, max_bytes: int
) -> Iterator[tuple[int, int, int, int]]:
    """(token_start, num_tokens, layer_start, num_layers) chunks within max_bytes, whole layers first:
    every token of as many layers as fit, so each layer's run of slots is one piece of a write (an
    engine pays ~50 us per piece of a few KiB)."""
    layer_bytes = num_tokens * bytes_per_token_layer
    layers = max(1, min(num_layers, max_bytes // layer_bytes))
    tokens = num_tokens if layers > 1 or layer_bytes <= max_bytes else max(1, max_bytes // bytes_per_token_layer)
    for l0 in range(0, num_layers, layers):
        for t0 in range(0, num_tokens, tokens):
            yield t0, min(tokens, num_tokens - t0), l0, min(layers, num_layers - l0)


def write_plan(
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    region: prefill_pb2.KvRegion,
    runs,
    token_start: int,
    num_tokens: int,
    layer_start: int,
    num_layers: int,
) -> tuple[list[int], list[int], list[int]]:
    """(sources, destinations, lengths) that write tokens [token_start, +num_tokens) of layers
    [layer_start, +num_layers) from the handoff's KV (per layer [prompt_len, kv_heads, head_dim],
    contiguous, on the host or a device) into the region's slots."""
    size = region.slot_bytes
    srcs, dsts, lens = [], [], []
    end = token_start + num_tokens
    for run in runs:
        lo = max(token_start, run.token_start)
        hi = min(end, run.token_start + run.length)
        if lo >= hi:
            continue
        slot = run.slot + (lo - run.token_start)
        for layer in range(layer_start, layer_start + num_layers):
            pairs = [(k[layer], region.k_ptrs[layer])] + ([(v[layer], region.v_ptrs[layer])] if region.v_ptrs else [])
            for src, base in pairs:
                srcs.append(src.data_ptr() + lo * size)
                dsts.append(base + slot * size)
                lens.append((hi - lo) * size)
    return srcs, dsts, lens
