"""The decode side of the transfer-engine data plane (--disaggregation-transfer-backend mooncake or shm).

At start-up the KV pools (the target's, and the EAGLE head's, which shares slot indices) are
registered once with a transfer engine, or with shm were made as shared-memory files
(common/engine/shared_memory.py); `destination` is what every Prefill call then names: the
session (the engine's, or the files') and each pool's per-layer addresses (the prefill client adds
the request's slot runs). The prefill replica writes K and V there and sends a notice per chunk;
the scheduler reads a request's slots only after its record, i.e. after every notice (DESIGN
section 3). With tensor parallelism every rank does so with its own pools; `join_ranks` joins their
`rank_destination`s (each naming the KV heads it holds) into rank 0's destination.
`keys` (one per rank) sign each call's destination (common/wire/kv_capability.py): the secret of the
pool files with shm, a key derived from the internal API key with mooncake (None without one).
"""

from __future__ import annotations

from common.engine import shared_memory
from common.engine.model_runner import ModelRunner
from common.parallel.tp_shard import kv_heads_of
from common.wire import kv_capability, mooncake, shm_transfer
from common.wire.proto_gen import prefill_pb2


class KvReceiver:
    @staticmethod
    def check(config) -> None:
        """Refuse a backend that cannot work here: mooncake where the engine does not load, shm for
        pools off the CPU (on GPUs the KV stays in device memory: use mooncake)."""
        if config.disaggregation_transfer_backend == "mooncake":
            mooncake.require()
        if config.disaggregation_transfer_backend == "shm" and config.device != "cpu":
            raise ValueError(shared_memory.CPU_ONLY)

    @classmethod
    def for_service(cls, runner: ModelRunner, config, tp=None) -> KvReceiver | None:
        """The service's receiver (None with the grpc backend); under TP every rank builds one at the
        same point (they join)."""
        if config.disaggregation_transfer_backend == "grpc":
            return None
        receiver = cls(
            runner,
            config.host,
            config.disaggregation_protocol,
            config.disaggregation_ib_device,
            kv_capability.key_from_internal(config.internal_api_key),
        )
        if tp is not None and tp.size > 1:
            join_ranks(tp, receiver, kv_heads_of(runner.config, tp.rank, tp.size))
        return receiver

    def __init__(
        self,
        runner: ModelRunner,
        bind_host: str,
        protocol: str = "tcp",
        device: str = "",
        mooncake_key: bytes | None = None,
    ):
        """With pools in shared-memory files (the shm backend) the session names the files; else a
        mooncake engine's (`protocol` tcp or rdma), its destinations signed with `mooncake_key`."""
        pools = [runner.kv_pool] + ([runner.draft.kv_pool] if runner.draft is not None else [])
        files = [f for pool in pools for f in pool.files]
        if files:
            self.engine = shm_transfer.ShmEndpoint(files)
            key = self.engine.key
        else:
            self.engine = mooncake.TransferEngine(mooncake.advertised_host(bind_host), protocol, device)
            key = mooncake_key
        self.keys: list[bytes] | None = None if key is None else [key]  # rank 0's: every rank's (join_ranks)
        for pool in pools:
            self.engine.register(pool.k + pool.v)
        self.destination = prefill_pb2.KvDestination(
            session=self.engine.session, target=mooncake.kv_region(runner.kv_pool.k, runner.kv_pool.v)
        )
        if runner.draft is not None:
            self.destination.draft.CopyFrom(mooncake.kv_region(runner.draft.kv_pool.k, runner.draft.kv_pool.v))

    def rank_destination(self, heads: range) -> prefill_pb2.KvRankDestination:
        """This rank's pools as one rank of a tensor-parallel destination (it holds KV `heads`)."""
        d = self.destination
        out = prefill_pb2.KvRankDestination(
            session=d.session, target=d.target, kv_head_start=heads.start, kv_head_count=len(heads)
        )
        if d.HasField("draft"):
            out.draft.CopyFrom(d.draft)
        return out


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
