"""The prefill replicas a decode service calls: one channel each, their health, and which one a call goes to.

`Replica`: one replica's channel and stubs, its cached health and its load (GetLoad).
`ReplicaPool`: the replicas `--prefill-addr` names now (dns entries re-resolved every
`resolve_interval_s` by prefill_discovery.py), and `pick`: among the serving ones not yet tried, the one
prefix_router.py chooses (the replica whose prefix cache likely holds the prompt's prefix unless the
loads are far apart, else the least loaded: its GetLoad plus our own calls in flight to it), waiting up
to `wait_ready_s` while none is ready. A replica gone from the name takes no new calls; its channel is
closed with the pool.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire import security
from common.wire.grpc_server import channel_options
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from decode_service import prefill_discovery
from decode_service.prefix_router import PrefixRouter

logger = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 1.0  # one health check's bound
BUSY_GRACE_S = 5.0  # a replica that answered SERVING this recently and now only times out is busy, not down
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
UNREACHABLE_LOAD = 1 << 30  # the load of a replica whose GetLoad failed: chosen last


PREFILL_METHOD = f"/{SERVICE_NAME}/Prefill"
GET_LOAD_METHOD = f"/{SERVICE_NAME}/GetLoad"


class Replica:
    def __init__(self, address: str, credentials=None, key: str | None = None):
        self.address = address
        self.credentials = credentials  # TLS to this replica, or None
        self._key = key  # the internal API key, if any: proven per call, never sent (security.py)
        self.channel = security.channel(address, channel_options(keepalive=True), credentials)
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.in_flight = 0  # our calls to this replica (guarded by the pool's lock)
        self.serving_at: float | None = None  # monotonic time of its last SERVING answer

    def serving(self, fresh: bool = False) -> bool:
        """Health over our channel; with `fresh`, over a new one, so a replica that just came up is
        seen at once (our channel may still wait out its reconnect backoff, up to 1 s). A check that
        only times out (a replica busy streaming KV on shared cores can take over a second to answer)
        keeps a SERVING answer of the last BUSY_GRACE_S; a refused connection or NOT_SERVING does not.
        A replica wedged past that is caught by the calls' progress watchdog."""
        channel = security.channel(self.address, channel_options(), self.credentials) if fresh else None
        health = health_pb2_grpc.HealthStub(channel) if fresh else self.health
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=HEALTH_TIMEOUT_S)
            self.serving_at = time.monotonic() if reply.status == health_pb2.HealthCheckResponse.SERVING else None
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self.serving_at = None
        finally:
            if channel is not None:
                channel.close()
        return self.serving_at is not None and time.monotonic() - self.serving_at < BUSY_GRACE_S

    def auth(self, method: str) -> tuple:
        """The metadata of one call of `method`: a fresh token made with the key (none without one)."""
        return security.signed_metadata(self._key, method)

    def load(self) -> tuple[int, int]:
        """(running + waiting calls, KV pool size) from the replica's GetLoad."""
        try:
            r = self.stub.GetLoad(prefill_pb2.LoadRequest(), timeout=1.0, metadata=self.auth(GET_LOAD_METHOD))
            return r.num_running_reqs + r.num_waiting_reqs, r.max_total_tokens
        except grpc.RpcError:
            return UNREACHABLE_LOAD, 0


class ReplicaPool:
    def __init__(self, entries: list[str], credentials=None, api_key: str | None = None, policy: str = "cache_aware"):
        """`entries`: HOST:PORT and dns:///NAME:PORT (prefill_discovery.py); `policy`: prefix_router.py's."""
        if not entries:
            raise ValueError("at least one prefill address is needed")
        self.entries = list(entries)
        self._credentials, self._key = credentials, api_key
        self.members = [self._replica(a) for a in prefill_discovery.expand(self.entries)]
        self._retired: list[Replica] = []  # gone from the name: no new calls, closed at close()
        self.router = PrefixRouter(policy)
        self._lock = threading.Lock()  # in_flight, the router, the members list's replacement

    def _replica(self, address: str) -> Replica:
        return Replica(address, self._credentials, self._key)

    def any_serving(self, fresh: bool = False, map_=map) -> bool:
        """Whether a replica serves; `fresh` asks every replica over new channels (at once, given a
        thread pool's `map_`)."""
        if not fresh:
            return any(p.serving() for p in self.members)
        return any(map_(lambda p: p.serving(fresh=True), self.members))

    def pick(self, exclude: set[str], prompt: list[int], wait_s: float) -> Replica | None:
        """A serving replica not in `exclude` (addresses), its in_flight counted (`release` it after
        the call); None if none is ready within `wait_s`, or every replica is excluded."""
        deadline = time.monotonic() + wait_s
        while True:
            ready = [p for p in self.members if p.address not in exclude and p.serving()]
            if ready:
                replies = {p.address: p.load() for p in ready}  # RPCs outside the lock
                with self._lock:
                    loads = {p.address: replies[p.address][0] + p.in_flight for p in ready}
                    for address, (_, pool) in replies.items():
                        self.router.set_capacity(address, pool)
                    address = self.router.choose(loads, prompt)
                    replica = next(p for p in ready if p.address == address)
                    replica.in_flight += 1
                return replica
            if time.monotonic() >= deadline or len(exclude) == len(self.members):
                return None
            time.sleep(0.2)

    def release(self, replica: Replica) -> None:
        """A call to `replica` from `pick` ended."""
        with self._lock:
            replica.in_flight -= 1

    def refresh(self) -> None:
        """Re-resolve the dns entries: new replicas take calls from now on, vanished ones none."""
        addresses = prefill_discovery.expand(self.entries)
        with self._lock:
            current = {p.address: p for p in self.members}
            self.members = [current.get(a) or self._replica(a) for a in addresses]  # one assignment
            gone = [p for a, p in current.items() if a not in addresses]
            self._retired.extend(gone)
        added = sorted(set(addresses) - set(current))
        if added or gone:
            logger.info("prefill replicas: %s joined, %s left", added, [p.address for p in gone])

    def rediscover_until(self, closed: threading.Event, interval: float) -> None:
        """With dns entries, a daemon thread refreshes them every `interval` seconds until `closed`."""
        if prefill_discovery.has_dns(self.entries):
            threading.Thread(
                target=self._rediscover, args=(closed, interval), name="prefill-discovery", daemon=True
            ).start()

    def _rediscover(self, closed: threading.Event, interval: float) -> None:
        while not closed.wait(interval):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - keep the replicas we have
                logger.exception("re-resolving the prefill addresses failed")

    def close(self) -> None:
        for p in self.members + self._retired:
            p.channel.close()
