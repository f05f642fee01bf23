"""Write one handoff's KV through the transfer engine (mooncake, or shared memory on one host:
common/wire/shm_transfer.py) into the decode side's reserved slots.

The KV part of a Prefill stream when the call names a `kv_destination` and this replica has a
transfer engine: the handoff's host K and V are registered once, then chunk by chunk (whole layers
first, bounded by max_bytes, so each layer's slot run is one piece) one batch of writes lands in decode's slots
and a `KvWritten` notice follows it; the head's KV follows the target's with EAGLE. A tensor-parallel
decode side names every rank: each gets the KV heads it holds (and the head's whole KV), and one
notice follows a chunk's writes to all of them. A cancelled call
writes nothing more (a write already started completes). Runs on a worker thread: it blocks.
Before anything is written, each target's capability must verify (common/wire/kv_capability.py): a
caller cannot name pools, an engine or slots that decode did not sign for this request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from common.engine.handoff import Handoff
from common.wire import kv_capability, kv_chunks, mooncake, shm_transfer
from common.wire.proto_gen import prefill_pb2


def _rank_parts(dest: prefill_pb2.KvDestination, handoff: Handoff) -> list[tuple]:
    """(session, k, v, region, draft) of every write target: the one destination, or with a
    tensor-parallel decode side each rank with the KV heads it holds (copies of those heads) and,
    with EAGLE, the head's whole KV into every rank's draft pool."""
    ranks = kv_capability.ranks(dest)
    heads = handoff.k[0].shape[1]
    parts = []
    for r in ranks:
        if dest.tp_ranks:
            a, n = r.kv_head_start, r.kv_head_count
            if n == 0 or a + n > heads:
                raise ValueError(f"kv_destination rank holds KV heads [{a}, {a + n}); the model has {heads}")
            k = handoff.k if n == heads else [t[:, a : a + n].contiguous() for t in handoff.k]
            v = handoff.v if n == heads else [t[:, a : a + n].contiguous() for t in handoff.v]
        else:
            k, v = handoff.k, handoff.v
        parts.append((r.session, k, v, r.target, False))
        if handoff.draft_k is not None:
            if not r.HasField("draft"):
                raise ValueError("kv_destination has no draft pool, but this replica runs an EAGLE head")
            parts.append((r.session, handoff.draft_k, handoff.draft_v, r.draft, True))
    return parts


def can_write(engine, dest: prefill_pb2.KvDestination) -> bool:
    """Whether `engine` (ours, or None) writes to `dest`: shared-memory sessions need our ShmWriter
    and files it can map (a decode side on this host), any other a mooncake engine; else the KV
    goes as gRPC bytes."""
    if engine is None:
        return False
    sessions = [r.session for r in kv_capability.ranks(dest)]
    if not isinstance(engine, shm_transfer.ShmWriter):
        return not any(s.startswith(shm_transfer.SESSION_PREFIX) for s in sessions)
    return all(s.startswith(shm_transfer.SESSION_PREFIX) and engine.reaches(s) for s in sessions)


def authorize(engine, dest: prefill_pb2.KvDestination, request_id: str) -> None:
    """CapabilityRefused (or ShmTransferError) unless decode signed every target of `dest` for this
    request; a mooncake engine without a key (no internal API key) writes unsigned destinations."""
    for rank in kv_capability.ranks(dest):
        key = engine.capability_key(rank.session)
        if key is not None:
            engine.capabilities.check(key, request_id, rank, dest.runs)


def write_handoff(
    engine: mooncake.TransferEngine | shm_transfer.ShmWriter,
    dest: prefill_pb2.KvDestination,
    handoff: Handoff,
    max_bytes: int,
    cancelled: Callable[[], bool],
) -> Iterator[prefill_pb2.PrefillChunk]:
    n = handoff.prompt_len
    authorize(engine, dest, handoff.rid)
    parts = _rank_parts(dest, handoff)
    for _, k, _, region, _ in parts:
        mooncake.check_destination(dest, region, n, len(k), k[0][:1].numel() * k[0].element_size())
    tensors = list({id(t): t for _, k, v, _, _ in parts for t in k + v}.values())
    engine.register(tensors)
    try:
        for draft in (False, True):  # the target's KV, then the head's: a notice per chunk covers every rank
            mine = [p for p in parts if p[4] == draft]
            if not mine:
                continue
            whole = handoff.draft_k if draft else handoff.k  # a token's bytes over all heads bound a chunk
            per = 2 * whole[0][:1].numel() * whole[0].element_size()
            for t0, nt, l0, nl in kv_chunks.plan_by_layer(n, len(whole), per, max_bytes):
                if cancelled():
                    return
                total = 0
                for session, k, v, region, _ in mine:
                    srcs, dsts, lens = mooncake.write_plan(k, v, region, dest.runs, t0, nt, l0, nl)
                    engine.write(session, srcs, dsts, lens)
                    total += sum(lens)
                notice = prefill_pb2.KvWritten(
                    token_start=t0, num_tokens=nt, layer_start=l0, num_layers=nl, draft=draft, bytes=total
                )
                yield prefill_pb2.PrefillChunk(written=notice)
    finally:
        engine.unregister(tensors)


def send_handoff(handoff: Handoff, max_bytes: int) -> Iterator[prefill_pb2.PrefillChunk]:
    """The gRPC path: the KV itself as bounded KvChunks (the head's after the target's)."""
    yield from kv_chunks.split(handoff.k, handoff.v, max_bytes)
    if handoff.draft_k is not None:
        yield from kv_chunks.split(handoff.draft_k, handoff.draft_v, max_bytes, draft=True)


class Outbox:
    """A handoff's KV messages for a pool of worker threads, one `take` (one executor call) per
    message. Each take builds the message after the one it returns, so the take that returns the last
    message knows it and builds the record's draft seed too: a request's record never waits behind
    other requests' chunks in the pool's queue, as a separate call for the end (or the seed) would."""

    _UNSET = object()

    def __init__(self, messages: Iterator[prefill_pb2.PrefillChunk], handoff: Handoff):
        self._messages, self._handoff = messages, handoff
        self._ahead = self._UNSET

    def take(self) -> tuple[prefill_pb2.PrefillChunk | None, dict | None]:
        """(the next message, or None if there was none; the draft seed once no message is left, else None)."""
        message = next(self._messages, None) if self._ahead is self._UNSET else self._ahead
        self._ahead = None if message is None else next(self._messages, None)
        return message, (kv_chunks.encode_seed(self._handoff) if self._ahead is None else None)
