"""Both roles of the backends that copy KV by address into decode's pools (Mooncake, shm).

Receiver (decode): the KV pools (the target's, and the EAGLE head's, which shares slot indices) are
registered once with an endpoint at start-up; `destination` names the endpoint's session and each
pool's per-layer addresses, and every Prefill call sends it with the request's slot runs, signed
with `keys` (one per rank; None: unsigned). `rank_destination` is this rank's part of a
tensor-parallel destination (receiver.join_ranks gathers them into rank 0's).

Sender (prefill): a call whose destination this replica `reaches` gets its KV written into those
slots: the capability of every target verified first (plan.authorize), the KV registered once, then
chunk by chunk (whole layers first, at most max_bytes) one batch of writes per target and one
`KvWritten` notice for all of them; the head's KV follows the target's with EAGLE. A tensor-parallel
destination gets each rank's KV heads. A cancelled call writes nothing more (a write already started
completes). Any other call (no destination, or one out of reach) gets bytes (grpc_bytes.py). The
writes block: the server runs them on its transfer threads.

A subclass gives `label`, `writer` (what registers, unregisters and writes by address, with
capability_key and capabilities: Mooncake's TransferEngine, or shm's ShmWriter), `reaches(dest)`,
`reads_device` (a writer that reads device memory gets device-staged KV as it is; any other gets it
copied to the host on the transfer thread: staging.py) and, for the receiver, the endpoint and key
it registers the pools with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from common.kv_transfer import grpc_bytes, plan, staging
from common.kv_transfer.errors import as_transfer_errors
from common.wire.proto_gen import prefill_pb2


class AddressSender:
    label = ""
    writer = None
    reads_device = False  # the writer reads device memory itself (else device-staged KV is copied to the host)

    def reaches(self, dest: prefill_pb2.KvDestination) -> bool:
        raise NotImplementedError

    def staging_device(self, pool_device) -> torch.device:
        """Host memory (Mooncake answers the pool's device: its copy-out never waits for the device)."""
        return staging.HOST

    def messages(
        self,
        request_id: str,
        dest: prefill_pb2.KvDestination | None,
        handoff,
        max_bytes: int,
        cancelled: Callable[[], bool],
    ) -> tuple[str, Iterator[prefill_pb2.PrefillChunk]]:
        if dest is not None and self.reaches(dest):
            return self.label, as_transfer_errors(self._write(request_id, dest, handoff, max_bytes, cancelled))
        return grpc_bytes.LABEL, as_transfer_errors(grpc_bytes.kv_messages(handoff, max_bytes))

    def close(self) -> None:
        close = getattr(self.writer, "close", None)
        if close is not None:
            close()

    def _write(self, request_id, dest, handoff, max_bytes, cancelled) -> Iterator[prefill_pb2.PrefillChunk]:
        writer, n = self.writer, handoff.kv_len  # positions kv_start..: the destination's runs count from there
        plan.authorize(writer, dest, request_id)
        staging.wait_ready(handoff)
        if not self.reads_device:
            handoff = staging.host_handoff(handoff)
        with staging.side_stream(handoff.k[0].device):  # a TP rank's heads: copies made, and finished, here
            parts = plan.rank_parts(dest, handoff)
        for _, k, v, region, _ in parts:
            slot_bytes, with_v = k[0][:1].numel() * k[0].element_size(), v[0][:1].numel() > 0
            plan.check_destination(dest, region, n, len(k), slot_bytes, with_v)
        tensors = list({id(t): t for _, k, v, _, _ in parts for t in k + v}.values())
        writer.register(tensors)
        try:
            for draft in (False, True):  # the target's KV, then the head's: a notice per chunk covers every rank
                mine = [p for p in parts if p[4] == draft]
                if not mine:
                    continue
                whole = handoff.draft_k if draft else handoff.k  # a token's bytes over all heads bound a chunk
                whole_v = handoff.draft_v if draft else handoff.v
                per = (whole[0][:1].numel() + whole_v[0][:1].numel()) * whole[0].element_size()
                for t0, nt, l0, nl in plan.plan_by_layer(n, len(whole), per, max_bytes):
                    if cancelled():
                        return
                    total = 0
                    for session, k, v, region, _ in mine:
                        srcs, dsts, lens = plan.write_plan(k, v, region, dest.runs, t0, nt, l0, nl)
                        writer.write(session, srcs, dsts, lens)
                        total += sum(lens)
                    notice = prefill_pb2.KvWritten(
                        token_start=t0, num_tokens=nt, layer_start=l0, num_layers=nl, draft=draft, bytes=total
                    )
                    yield prefill_pb2.PrefillChunk(written=notice)
        finally:
            writer.unregister(tensors)


QUIESCE_S = 1.0  # a write of a call that ended early lands within this (one chunk's copy at most)


class PoolReceiver:
    writes_late = True  # the replica writes the reserved slots itself, until its call has ended
    quiesce_s = QUIESCE_S

    def settle(self) -> None:
        """A call ended early (broken, cancelled): a chunk it was writing may still land; wait it out,
        so the slots can be retried or handed to another request. No notice tells a late write apart."""
        time.sleep(self.quiesce_s)

    @staticmethod
    def pool_memory(config) -> str | None:
        """Where the pools must be made (None: ordinary memory; shm overrides it)."""
        return None

    def __init__(self, runner, endpoint, key: bytes | None):
        """Register the runner's pools with `endpoint` (it has `session` and `register`); `key` signs
        this rank's destinations (None: unsigned)."""
        self.endpoint = endpoint
        self.keys: list[bytes] | None = None if key is None else [key]  # rank 0's: every rank's (join_ranks)
        pools = [runner.kv_pool] + ([runner.draft.kv_pool] if runner.draft is not None else [])
        for pool in pools:
            endpoint.register([t for t in pool.k + pool.v if t.numel()])  # a latent pool's V holds nothing
        self.destination = prefill_pb2.KvDestination(
            session=endpoint.session, target=plan.kv_region(runner.kv_pool.k, runner.kv_pool.v)
        )
        if runner.draft is not None:
            self.destination.draft.CopyFrom(plan.kv_region(runner.draft.kv_pool.k, runner.draft.kv_pool.v))

    def rank_destination(self, heads: range) -> prefill_pb2.KvRankDestination:
        """This rank's pools as one rank of a tensor-parallel destination (it holds KV `heads`)."""
        d = self.destination
        out = prefill_pb2.KvRankDestination(
            session=d.session, target=d.target, kv_head_start=heads.start, kv_head_count=len(heads)
        )
        if d.HasField("draft"):
            out.draft.CopyFrom(d.draft)
        return out
