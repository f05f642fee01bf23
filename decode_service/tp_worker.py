"""Tensor parallelism behind the worker seam: rank 0's worker sends every piece of stream work to the
other ranks, which run the same work on their part of the model (common/parallel/tp_shard.py).

Lifecycle (decode service with --tp-size N):
  1. every rank loads its shard and warms up (the warm-up's collectives pair up across ranks);
  2. rank 0 serves gRPC and runs the scheduler with a TPDecodeWorker; ranks 1..N-1 run `follow`;
  3. each stream item on rank 0 first scatters a message to the ranks (in stream order, so all ranks
     run the same forwards in the same order), then runs the same message itself:
       ("forward", batch)   a decode or EAGLE step; every rank gathers the full logits and samples
                            the same tokens, so each rank's FutureMap stays identical;
       ("kv", ...)          a handed-over KV chunk, cut to the KV heads that rank holds;
       ("prebuilt", ...)    a handoff's row, KV (cut the same way) and FutureMap seeds;
       ("release", row)     a released row's guard cleared;
       ("stop",)            the followers return;
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
from common.engine.host_copy import to_device
from common.engine.streams import StreamFailed
from common.parallel.tp_group import TPGroup
from common.parallel.tp_shard import kv_heads_of
from decode_service.handoff_writes import write_kv_chunk, write_prebuilt
from decode_service.worker import DecodeWorker
from decode_service.worker_batch import BatchResult, WorkerBatch

log = logging.getLogger(__name__)


def _heads(tensors, heads: range):
    """KV cut to `heads` (copies: a rank's message holds only its part): a list of per-layer tensors
    [T, KV heads, D], or a chunk's one tensor [layers, T, KV heads, D]."""
    if isinstance(tensors, torch.Tensor):
        return tensors[:, :, heads.start : heads.stop].clone()
    return None if tensors is None else [t[:, heads.start : heads.stop].clone() for t in tensors]


def cut_kv_message(message: tuple, config, rank: int, size: int) -> tuple:
    """The part of a KV-carrying message rank `rank` of `size` receives (target KV heads it holds)."""
    heads = kv_heads_of(config, rank, size)
    if message[0] == "kv" and not message[-1]:  # target KV (the draft head's is whole on every rank)
        kind, slots, token_start, layer_start, k, v, draft = message
        return kind, slots, token_start, layer_start, _heads(k, heads), _heads(v, heads), draft
    if message[0] == "prebuilt":
        kind, row, slots, handoff = message
        return kind, row, slots, dataclasses.replace(handoff, k=_heads(handoff.k, heads), v=_heads(handoff.v, heads))
    return message


def apply(worker: DecodeWorker, message: tuple) -> None:
    """Run one message's work on this rank (rank 0 on its stream, followers in `follow`)."""
    kind = message[0]
    if kind == "forward":
        worker.forward(message[1])
    elif kind == "kv":
        _, slots, token_start, layer_start, k, v, draft = message
        pool = worker.runner.draft.kv_pool if draft and worker.runner.draft is not None else worker.runner.kv_pool
        write_kv_chunk(pool, slots, token_start, layer_start, k, v)
    elif kind == "prebuilt":
        _, row, slots, handoff = message
        write_prebuilt(worker.runner, worker.future_map, row, slots, handoff)
    elif kind == "release":
        worker.future_map.reset_rows(to_device([message[1]], worker.future_map.device, torch.int64))
    else:
        raise ValueError(f"unknown TP message {kind!r}")


class TPDecodeWorker(DecodeWorker):
    """Rank 0's worker: the same seam, every stream item shared with the followers first."""

    def __init__(self, runner, tp: TPGroup, debug: bool = False):
        super().__init__(runner, debug)
        self.tp = tp

    def _send(self, message: tuple) -> tuple:
        """Scatter the message (each rank its KV heads) and return rank 0's own part."""
        parts = [cut_kv_message(message, self.runner.config, r, self.tp.size) for r in range(self.tp.size)]
        return self.tp.scatter_object(parts)

    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        if self.info.spec is not None:
            batch = dataclasses.replace(batch, fence=self.future_map.arm_publish(self.stream))
        shared = dataclasses.replace(batch, fence=None)
        return self._submit_forward(batch, lambda: self._send(("forward", shared)))

    def write_kv_chunk(self, kv_slots, token_start, layer_start, k, v, draft=False, done=None) -> None:
        def work():
            apply(self, self._send(("kv", kv_slots, token_start, layer_start, k, v, draft)))
            if done is not None:
                done()

        self.stream.submit(work)

    def write_prebuilt(self, req_pool_idx: int, kv_slots: torch.Tensor, handoff: Handoff) -> None:
        self.stream.submit(lambda: apply(self, self._send(("prebuilt", req_pool_idx, kv_slots, handoff))))

    def release_row(self, req_pool_idx: int) -> None:
        self.stream.submit(lambda: apply(self, self._send(("release", req_pool_idx))))

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
            self.stream.submit(lambda: self._send(("stop",)))
            self.stream.synchronize(timeout=10)
        except Exception as e:  # noqa: BLE001 (a follower already gone: nothing to stop)
            log.warning("TP followers not stopped cleanly: %s", e)
        super().close()


def follower_main(config, tp: TPGroup) -> None:
    """A follower rank of the decode service (common/parallel/launch.py starts it)."""
    from common.engine.model_runner import ModelRunner

    runner = ModelRunner.for_service(config, tp)
    from common.kv_transfer.receiver import make_receiver

    # mooncake or shm: this rank's pools registered (or shared), named in rank 0's destination
    receiver = make_receiver(runner, config, tp)
    follow(DecodeWorker(runner, debug=config.debug_checks), tp)
    del receiver  # kept registered until the follower stops


def follow(worker: DecodeWorker, tp: TPGroup) -> None:
    """A follower rank: run rank 0's messages until it says stop (or dies: the collective raises)."""
    while True:
        message = tp.scatter_object(None)
        if message[0] == "stop":
            return
        if message[0] == "forward" and worker.info.spec is not None:  # this rank's own publish fence
            batch = dataclasses.replace(message[1], fence=worker.future_map.arm_publish(worker.stream))
            message = ("forward", batch)
        apply(worker, message)
