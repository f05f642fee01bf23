"""Write one handoff's KV through the transfer engine into the decode side's reserved slots.

The KV part of a Prefill stream when the call names a `kv_destination` and this replica has a
transfer engine: the handoff's host K and V are registered once, then chunk by chunk (whole layers
first, bounded by max_bytes, so each layer's slot run is one piece) one batch of writes lands in decode's slots
and a `KvWritten` notice follows it; the head's KV follows the target's with EAGLE. A cancelled call
writes nothing more (a write already started completes). Runs on a worker thread: it blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from common.engine.handoff import Handoff
from common.wire import kv_chunks, mooncake
from common.wire.proto_gen import prefill_pb2


def write_handoff(
    engine: mooncake.TransferEngine,
    dest: prefill_pb2.KvDestination,
    handoff: Handoff,
    max_bytes: int,
    cancelled: Callable[[], bool],
) -> Iterator[prefill_pb2.PrefillChunk]:
    n = handoff.prompt_len
    slot_bytes = handoff.k[0][:1].numel() * handoff.k[0].element_size()
    mooncake.check_destination(dest, n, len(handoff.k), slot_bytes)
    parts = [(handoff.k, handoff.v, dest.target, False)]
    if handoff.draft_k is not None:
        if not dest.HasField("draft"):
            raise ValueError("kv_destination has no draft pool, but this replica runs an EAGLE head")
        parts.append((handoff.draft_k, handoff.draft_v, dest.draft, True))
    tensors = [t for k, v, _, _ in parts for t in k + v]
    engine.register(tensors)
    try:
        for k, v, region, draft in parts:
            per = 2 * k[0][:1].numel() * k[0].element_size()
            for t0, nt, l0, nl in kv_chunks.plan_by_layer(n, len(k), per, max_bytes):
                if cancelled():
                    return
                srcs, dsts, lens = mooncake.write_plan(k, v, region, dest.runs, t0, nt, l0, nl)
                engine.write(dest.session, srcs, dsts, lens)
                notice = prefill_pb2.KvWritten(
                    token_start=t0, num_tokens=nt, layer_start=l0, num_layers=nl, draft=draft, bytes=sum(lens)
                )
                yield prefill_pb2.PrefillChunk(written=notice)
    finally:
        engine.unregister(tensors)


def send_handoff(handoff: Handoff, max_bytes: int) -> Iterator[prefill_pb2.PrefillChunk]:
    """The gRPC path: the KV itself as bounded KvChunks (the head's after the target's)."""
    for chunk in kv_chunks.split(handoff.k, handoff.v, max_bytes):
        yield prefill_pb2.PrefillChunk(kv=chunk)
    if handoff.draft_k is not None:
        for chunk in kv_chunks.split(handoff.draft_k, handoff.draft_v, max_bytes, draft=True):
            yield prefill_pb2.PrefillChunk(kv=chunk)
