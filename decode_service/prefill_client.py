"""PrefillClient: the decode side of the internal Prefill API (one channel per prefill replica).

Called by the scheduler with a HandoffRequest once the request's slots are reserved; the call runs on a
worker thread. The parts:
- prefill_replicas.py: the replicas (dns entries re-resolved), their health, and which one a call goes
  to (prefix_router.py: the one whose prefix cache likely holds the prompt's prefix unless the loads
  are far apart, else the least loaded; waits up to `wait_ready_s` if none is ready);
- replica_call.py: one request's call: attempts streamed (prefill_stream.py checks each message and
  forwards the first token at once, each KV chunk to be written into the reserved slots, then the
  record as a Handoff) and retried on another replica if one breaks, ending in exactly one
  `deliver_handoff` or `fail_handoff`;
- prefill_inflight.py: the requests in flight, their cancellation, and the watchdog that cancels an
  attempt silent for `progress_timeout_s` once its first token is in (a stalled, stopped or wedged
  replica; HTTP/2 keepalive pings also break calls to a vanished host).
"""

from __future__ import annotations

import threading
from concurrent import futures

from common.engine.handoff import Handoff, HandoffRequest
from common.forward import intra_op
from common.kv_transfer import grpc_bytes
from decode_service import replica_call
from decode_service.prefill_inflight import InFlightCalls
from decode_service.prefill_replicas import BUSY_GRACE_S, SERVICE_NAME, Replica, ReplicaPool
from decode_service.prefill_stream import MAX_PENDING_CHUNKS
from decode_service.replica_call import ReplicaCall

__all__ = ["BUSY_GRACE_S", "MAX_PENDING_CHUNKS", "SERVICE_NAME", "PrefillClient"]


class PrefillClient:
    def __init__(
        self,
        addresses: list[str],
        model_config,
        sink,
        wait_ready_s: float = 30.0,
        max_chunk_bytes: int = 0,
        max_concurrent: int = 64,  # 0: the server's bound
        call_timeout_s: float = 600.0,
        draft_config=None,
        progress_timeout_s: float = 5.0,
        metrics=None,
        kv_receiver=None,
        credentials=None,
        api_key: str | None = None,
        policy: str = "cache_aware",
        resolve_interval_s: float = 5.0,
        tracing=None,
    ):
        """`sink` receives what the calls bring (the scheduler's Inbox: deliver_first_token, deliver_kv,
        deliver_handoff, fail_handoff); `metrics`: DecodeMetrics or None. `kv_receiver`: this side's KV
        receiver (common/kv_transfer/receiver.py; None: KV as bytes on the stream). With a destination (a
        transfer engine's session and registered pools) each call names its reserved slots and the
        replica writes the KV there (each attempt's destination signed with the receiver's keys, one per
        rank, until its deadline: common/wire/kv_capability.py); a call that ends early is reported once
        the receiver has settled, so a write still landing cannot reach slots the scheduler has handed
        to another request.
        `policy`: how a replica is chosen (prefix_router.py: follow the replicas' prefix caches, or
        least loaded). `addresses` may hold dns:///NAME:PORT entries, re-resolved every
        `resolve_interval_s` (prefill_discovery.py)."""
        self.replicas = ReplicaPool(addresses, credentials, api_key, policy)
        self.config = model_config
        self.draft_config = draft_config  # EAGLE: the head's layer config (its KV chunks' shape)
        self.sink = sink
        self.wait_ready_s = wait_ready_s
        self.max_chunk_bytes = max_chunk_bytes
        self.call_timeout_s = call_timeout_s  # a wedged replica cannot hold a reservation forever
        self._pool = futures.ThreadPoolExecutor(
            max_workers=max_concurrent, thread_name_prefix="prefill-call", initializer=intra_op.pin_single
        )  # intra_op.py
        self.progress_timeout_s = progress_timeout_s
        self.calls = InFlightCalls()  # rid -> its InFlight record (prefill_inflight.py)
        self._closed = threading.Event()
        self.calls.watch(self._closed, progress_timeout_s)
        self.retries = 0  # calls retried on another replica since start
        self.metrics = metrics
        self.kv_receiver = kv_receiver or grpc_bytes.BytesReceiver()
        self.kv_destination, self.kv_keys = self.kv_receiver.destination, self.kv_receiver.keys
        self.tracing = tracing  # common.tracing.Tracing or None
        self.replicas.rediscover_until(self._closed, resolve_interval_s)

    @property
    def entries(self) -> list[str]:
        return self.replicas.entries

    @property
    def router(self):
        return self.replicas.router

    def __call__(self, request: HandoffRequest) -> None:
        self.calls.begin(request.rid)
        self._pool.submit(self._run, request)

    def any_serving(self, fresh: bool = False) -> bool:
        """Whether a replica serves; `fresh` asks every replica at once over new channels."""
        return self.replicas.any_serving(fresh, self._pool.map)

    def cancel(self, rid: str) -> None:
        self.calls.cancel(rid)

    def replica_of(self, rid: str) -> str | None:
        """The replica a request's prefill call is streaming from right now (for tests and logs)."""
        replica = self.calls.replica_of(rid)
        return replica.address if replica is not None else None

    def close(self) -> None:
        """Cancel every call in flight (no retries), stop the workers, close the channels."""
        self._closed.set()
        self.calls.cancel_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.replicas.close()

    def _run(self, request: HandoffRequest) -> None:
        ReplicaCall(self, request).run()

    def _stream(self, replica: Replica, request: HandoffRequest, sent: list[int], trace_metadata=()) -> Handoff:
        """One attempt (tests wrap this to see each attempt's outcome)."""
        return replica_call.attempt(self, replica, request, sent, trace_metadata)
