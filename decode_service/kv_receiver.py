"""The decode side of the transfer-engine data plane (--disaggregation-transfer-backend mooncake).

At start-up the KV pools (the target's, and the EAGLE head's, which shares slot indices) are
registered once with a transfer engine; `destination` is what every Prefill call then names: the
engine's session and each pool's per-layer addresses (the prefill client adds the request's slot
runs). The prefill replica writes K and V there and sends a notice per chunk; the scheduler reads a
request's slots only after its record, i.e. after every notice (DESIGN section 3).
"""

from __future__ import annotations

from common.engine.model_runner import ModelRunner
from common.wire import mooncake
from common.wire.proto_gen import prefill_pb2


class KvReceiver:
    def __init__(self, runner: ModelRunner, bind_host: str, protocol: str = "tcp", device: str = ""):
        self.engine = mooncake.TransferEngine(mooncake.advertised_host(bind_host), protocol, device)
        pools = [runner.kv_pool] + ([runner.draft.kv_pool] if runner.draft is not None else [])
        for pool in pools:
            self.engine.register(pool.k + pool.v)
        self.destination = prefill_pb2.KvDestination(
            session=self.engine.session, target=mooncake.kv_region(runner.kv_pool.k, runner.kv_pool.v)
        )
        if runner.draft is not None:
            self.destination.draft.CopyFrom(mooncake.kv_region(runner.draft.kv_pool.k, runner.draft.kv_pool.v))
