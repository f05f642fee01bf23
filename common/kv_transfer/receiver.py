"""The receiver role of the KV transport: what a decode service sets up so prefill can deliver KV.

One receiver per decode rank, made by `make_receiver(runner, config, tp)` from
--disaggregation-transfer-backend (the only place that tells the backends apart on this side);
`check(config)` refuses, before any model loads, a backend that cannot work here, and
`pool_memory(config)` says where the pools must be made (shm: files of a shared folder). A
receiver has:

    receiver.destination
        the KvDestination every Prefill call names (the session and each pool's per-layer
        addresses; the prefill client adds the request's slot runs), or None: KV comes as bytes;
    receiver.keys
        the keys that sign each call's destination, one per rank (common/wire/kv_capability.py),
        or None: unsigned;
    receiver.rank_destination(heads)
        this rank's part of a tensor-parallel destination (it holds KV `heads`);
    receiver.writes_late, receiver.settle()
        whether slots may still be written after their call ended (a replica writing by address), and
        the wait until such a write can no longer land: the scheduler keeps an aborted request's slots
        until its prefill call has ended, and the prefill client settles before it retries or fails.

The decode side reads a request's slots only after its record, i.e. after every notice
(docs/architecture.md, section 5). With tensor parallelism every rank makes its receiver at the same point and
`join_ranks` gathers the ranks' parts and keys into rank 0's. Chunks that arrive as bytes are
checked and written by decode_service whatever the backend (grpc_bytes.py says why).
"""

from __future__ import annotations

from typing import Protocol

from common.kv_transfer import grpc_bytes, mooncake, shm
from common.parallel.tp_shard import kv_heads_of
from common.wire.proto_gen import prefill_pb2

_RECEIVERS = {
    grpc_bytes.LABEL: grpc_bytes.BytesReceiver,
    mooncake.LABEL: mooncake.MooncakeReceiver,
    shm.LABEL: shm.ShmReceiver,
}


class KvReceiver(Protocol):
    destination: prefill_pb2.KvDestination | None
    keys: list[bytes] | None
    writes_late: bool  # a replica writes into decode's slots itself: a write may land after its call ended

    def settle(self) -> None: ...  # returns once a write of a call that ended early can no longer land

    def rank_destination(self, heads: range) -> prefill_pb2.KvRankDestination: ...


def _backend(config):
    try:
        return _RECEIVERS[config.disaggregation_transfer_backend]
    except KeyError:
        raise ValueError(f"unknown KV transfer backend {config.disaggregation_transfer_backend!r}") from None


def pool_memory(config):
    """Where decode's KV pools must be made for this backend: an allocator of shared-memory files
    that prefill maps (shm: shm_files.allocator), or None (ordinary memory, host or device)."""
    return _backend(config).pool_memory(config)


def check(config) -> None:
    """Refuse a backend that cannot work here (mooncake where the engine does not load, shm for pools
    off the CPU), saying why."""
    _backend(config).check(config)


def make_receiver(runner, config, tp=None) -> KvReceiver:
    """This rank's receiver for the runner's pools; under TP every rank calls it at the same point
    (the ranks join: rank 0's destination names them all)."""
    receiver = _backend(config).from_config(runner, config)
    if receiver.destination is not None and tp is not None and tp.size > 1:
        join_ranks(tp, receiver, kv_heads_of(runner.config, tp.rank, tp.size))
    return receiver


def join_ranks(tp, receiver: KvReceiver, heads: range) -> None:
    """Every rank calls this at the same point: rank 0's destination then names every rank's pools,
    and its `keys` hold every rank's key. Each rank sends bytes: its key's length (0: none), its key,
    its destination."""
    key = receiver.keys[0] if receiver.keys else b""
    ranks = tp.all_gather_object(bytes([len(key)]) + key + receiver.rank_destination(heads).SerializeToString())
    if tp.rank == 0:
        keys = [r[1 : 1 + r[0]] for r in ranks]
        receiver.destination.tp_ranks.extend(prefill_pb2.KvRankDestination.FromString(r[1 + r[0] :]) for r in ranks)
        receiver.keys = keys if all(keys) else None
