"""Tensor parallelism behind the worker seam: rank 0's worker sends every piece of stream work to the
other ranks, which run the same work on their part of the model (common/parallel/tp_shard.py).

Lifecycle (decode service with --tp-size N):
  1. every rank loads its shard and warms up (the warm-up's collectives pair up across ranks);
  2. rank 0 serves gRPC and runs the scheduler with a TPDecodeWorker; ranks 1..N-1 run `follow`;
  3. each stream item on rank 0 first scatters a message of tp_messages.py to the ranks (in stream
     order, so all ranks run the same forwards in the same order), then runs the same message itself:
       Forward(batch)       a decode or EAGLE step; every rank gathers the full logits and samples
                            the same tokens, so each rank's FutureMap stays identical (and each
                            rank's grammar matchers, seeded and released with the rows below);
       WriteKvChunk(...)    a handed-over KV chunk, cut to the KV heads that rank holds;
       WritePrebuilt(...)   a handoff's row, KV (cut the same way) and FutureMap seeds;
       ReleaseRow(row)      a released row's guard cleared;
       Stop()               the followers return;
  4. a rank that dies fails the next collective on the others (gloo: the peer's socket closes), so
     rank 0's stream fails, health turns NOT_SERVING and calls end UNAVAILABLE; a follower whose
     rank 0 died exits.
The draft head (EAGLE/EAGLE3) is not split: each rank runs it whole (one layer; splitting it would
add two all-reduces per draft step for little memory), reading the vocabulary-parallel embedding and
lm_head through their collectives; a token map's rows come from the gathered lm_head (draft_runner.py).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from common.engine.handoff import Handoff
from common.engine.streams import StreamFailed
from common.forward.host_copy import to_device
from common.parallel.tp_group import TPGroup
from common.parallel.tp_shard import kv_heads_of
from decode_service.handoff_writes import ForkSeed, write_kv_chunk, write_prebuilt
from decode_service.hooks import DecodeHooks
from decode_service.tp_messages import (
    DecodeTPMessage,
    ExtendRow,
    Forward,
    ReleaseRow,
    Stop,
    WriteKvChunk,
    WritePrebuilt,
)
from decode_service.worker import DecodeWorker
from decode_service.worker_batch import BatchResult, WorkerBatch

log = logging.getLogger(__name__)


def _heads(tensors, heads: range):
    """KV cut to `heads` (copies: a rank's message holds only its part): a list of per-layer tensors
    [T, KV heads, D], or a chunk's one tensor [layers, T, KV heads, D]."""
    if isinstance(tensors, torch.Tensor):
        return tensors[:, :, heads.start : heads.stop].clone()
    return None if tensors is None else [t[:, heads.start : heads.stop].clone() for t in tensors]


def cut_kv_message(message: DecodeTPMessage, config, rank: int, size: int) -> DecodeTPMessage:
    """The part of a KV-carrying message rank `rank` of `size` receives (target KV heads it holds)."""
    heads = kv_heads_of(config, rank, size)
    if isinstance(message, WriteKvChunk) and not message.draft:  # the draft head's KV is whole everywhere
        return dataclasses.replace(message, k=_heads(message.k, heads), v=_heads(message.v, heads))
    if isinstance(message, WritePrebuilt):
        handoff = message.handoff
        cut = dataclasses.replace(handoff, k=_heads(handoff.k, heads), v=_heads(handoff.v, heads))
        return dataclasses.replace(message, handoff=cut)
    return message


def apply(worker: DecodeWorker, message: DecodeTPMessage) -> None:
    """Run one message's work on this rank (rank 0 on its stream, followers in `follow`)."""
    if isinstance(message, Forward):
        worker.forward(message.batch)
    elif isinstance(message, WriteKvChunk):
        draft = message.draft and worker.runner.draft is not None
        pool = worker.runner.draft.kv_pool if draft else worker.runner.kv_pool
        write_kv_chunk(pool, message.kv_slots, message.token_start, message.layer_start, message.k, message.v)
    elif isinstance(message, WritePrebuilt):
        write_prebuilt(
            worker.runner, worker.future_map, message.req_pool_idx, message.kv_slots, message.handoff, message.fork
        )
        if message.handoff.params.constraint is not None:  # every rank keeps its own matchers
            worker.seed_grammar(message.req_pool_idx, message.handoff)
    elif isinstance(message, ExtendRow):
        worker.runner.req_to_token_pool.write(message.req_pool_idx, message.start, message.slots)
    elif isinstance(message, ReleaseRow):
        worker.future_map.reset_rows(to_device([message.req_pool_idx], worker.future_map.device, torch.int64))
        worker.release_grammar(message.req_pool_idx)
    else:
        raise ValueError(f"unknown TP message {type(message).__name__}")


class TPDecodeWorker(DecodeWorker):
    """Rank 0's worker: the same seam, every stream item shared with the followers first."""

    def __init__(self, runner, tp: TPGroup, debug: bool = False, hooks: DecodeHooks | None = None):
        super().__init__(runner, debug, hooks)
        self.tp = tp

    def _send(self, message: DecodeTPMessage) -> DecodeTPMessage:
        """Scatter the message (each rank its KV heads) and return rank 0's own part."""
        parts = [cut_kv_message(message, self.runner.config, r, self.tp.size) for r in range(self.tp.size)]
        return self.tp.scatter_object(parts)

    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        if self.info.spec is not None:
            batch = dataclasses.replace(batch, fence=self.future_map.arm_publish(self.stream))
        shared = dataclasses.replace(batch, fence=None)
        return self._submit_forward(batch, lambda: self._send(Forward(shared)))

    def write_kv_chunk(self, kv_slots, token_start, layer_start, k, v, draft=False, done=None) -> None:
        def work():
            apply(self, self._send(WriteKvChunk(kv_slots, token_start, layer_start, k, v, draft)))
            if done is not None:
                done()

        self.stream.submit(work)

    def write_prebuilt(
        self, req_pool_idx: int, kv_slots: torch.Tensor, handoff: Handoff, fork: ForkSeed | None = None
    ) -> None:
        self.stream.submit(lambda: apply(self, self._send(WritePrebuilt(req_pool_idx, kv_slots, handoff, fork))))

    def extend_row(self, req_pool_idx: int, start: int, slots: torch.Tensor) -> None:
        self.stream.submit(lambda: apply(self, self._send(ExtendRow(req_pool_idx, start, slots))))

    def release_row(self, req_pool_idx: int) -> None:
        self.stream.submit(lambda: apply(self, self._send(ReleaseRow(req_pool_idx))))

    def fail(self, reason: str) -> None:
        """A rank died: the stream fails with `reason` (its next item raises), so does every later step."""

        def raise_it():
            raise RuntimeError(reason)

        log.error("%s: failing the decode stream", reason)
        try:
            self.stream.submit(raise_it)
        except StreamFailed:
            pass  # a collective with the dead rank already failed it

    def close(self) -> None:
        try:
            self.stream.submit(lambda: self._send(Stop()))
            self.stream.synchronize(timeout=10)
        except Exception as e:  # noqa: BLE001 (a follower already gone: nothing to stop)
            log.warning("TP followers not stopped cleanly: %s", e)
        super().close()


def follower_main(config, tp: TPGroup, hooks: DecodeHooks | None = None) -> None:
    """A follower rank of the decode service (common/parallel/launch.py starts it; `hooks` as rank 0's)."""
    from common.engine.model_runner import ModelRunner

    runner = ModelRunner.for_service(config, tp)
    from common.kv_transfer.receiver import make_receiver

    # mooncake or shm: this rank's pools registered (or shared), named in rank 0's destination
    receiver = make_receiver(runner, config, tp)
    follow(DecodeWorker(runner, debug=config.debug_checks, hooks=hooks), tp)
    del receiver  # kept registered until the follower stops


def follow(worker: DecodeWorker, tp: TPGroup) -> None:
    """A follower rank: run rank 0's messages until it says stop (or dies: the collective raises)."""
    while not isinstance(message := tp.scatter_object(None), Stop):
        if isinstance(message, Forward) and worker.info.spec is not None:  # this rank's own publish fence
            message = Forward(dataclasses.replace(message.batch, fence=worker.future_map.arm_publish(worker.stream)))
        apply(worker, message)
