"""PrefillClient: the decode side of the internal Prefill API (one channel per prefill replica).

Called by the scheduler with a HandoffRequest once the request's slots are reserved. On a worker
thread it picks a serving replica (prefix_router.py: the one whose prefix cache likely holds the
prompt's prefix unless the loads are far apart, else the least loaded: its GetLoad plus our own
calls in flight to it; waits up to `wait_ready_s` if none is ready), streams the call, and forwards: the first token at
once, each KV chunk (checked: ranges, shapes, exactly-once coverage) to be written into the
reserved slots, then the record as a Handoff. Once the first token is in, a call that sends nothing
for `progress_timeout_s` is cancelled by a watchdog (a stalled, stopped or wedged replica; HTTP/2
keepalive pings also break calls to a vanished host). A call that breaks is retried on another replica by
re-prefilling prompt + the tokens already sent (sampled at the next output position), so the client
never sees a token twice or changed. With no replica left it ends in exactly one `fail_handoff`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.engine import intra_op
from common.engine.handoff import Handoff, HandoffRequest, check_token
from common.request_rules import REFUSED
from common.wire import kv_chunks, security
from common.wire.grpc_server import channel_options
from common.wire.kv_chunks import KvAssembler, decode_seed
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from decode_service import prefill_discovery, prefill_request
from decode_service.prefix_router import PrefixRouter

logger = logging.getLogger(__name__)
MAX_PENDING_CHUNKS = 4  # per call: KV chunks handed to the scheduler and not yet written into the pool
HEALTH_TIMEOUT_S = 1.0  # one health check's bound
BUSY_GRACE_S = 5.0  # a replica that answered SERVING this recently and now only times out is busy, not down
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class _Peer:
    def __init__(self, address: str, credentials=None, metadata: tuple = ()):
        self.address = address
        self.credentials = credentials  # TLS to this replica, or None
        self.metadata = metadata  # the internal API key, if any
        self.channel = security.channel(address, channel_options(keepalive=True), credentials)
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.in_flight = 0  # our calls to this replica (guarded by the client's lock)
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

    def load(self) -> tuple[int, int]:
        """(running + waiting calls, KV pool size) from the replica's GetLoad."""
        try:
            r = self.stub.GetLoad(prefill_pb2.LoadRequest(), timeout=1.0, metadata=self.metadata)
            return r.num_running_reqs + r.num_waiting_reqs, r.max_total_tokens
        except grpc.RpcError:
            return 1 << 30, 0


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
        kv_destination: prefill_pb2.KvDestination | None = None,
        kv_keys: list[bytes] | None = None,
        transfer_quiesce_s: float = 1.0,
        credentials=None,
        api_key: str | None = None,
        policy: str = "cache_aware",
        resolve_interval_s: float = 5.0,
        tracing=None,
    ):
        """`sink` receives what the calls bring (the scheduler's Inbox: deliver_first_token, deliver_kv,
        deliver_handoff, fail_handoff); `metrics`: DecodeMetrics or None. With `kv_destination` (this
        side's transfer engine session and registered pools) each call names its reserved slots and the
        replica writes the KV there (each attempt's destination signed with `kv_keys`, one per rank, until
        its deadline: common/wire/kv_capability.py); a call that ends early is reported only
        `transfer_quiesce_s` later, so a write still landing cannot reach slots the scheduler has handed
        to another request.
        `policy`: how a replica is chosen (prefix_router.py: follow the replicas' prefix caches, or
        least loaded). `addresses` may hold dns:///NAME:PORT entries, re-resolved every
        `resolve_interval_s` (prefill_discovery.py)."""
        if not addresses:
            raise ValueError("at least one prefill address is needed")
        self.entries = list(addresses)
        self._peer_args = (credentials, security.key_metadata(api_key))
        self.peers = [_Peer(a, *self._peer_args) for a in prefill_discovery.expand(self.entries)]
        self._retired: list[_Peer] = []  # gone from the name: no new calls, closed at close()
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
        self._calls: dict[str, list] = {}  # rid -> [call, peer, time of its last message or None]
        self._stalled: set[str] = set()  # rids whose call the watchdog cancelled
        self._cancelled: set[str] = set()
        self._early_cancel: dict[str, bool] = {}  # cancelled before __call__ (insertion-ordered)
        self._active: set[str] = set()  # rids between __call__ and the end of _run
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._watchdog, name="prefill-watchdog", daemon=True).start()
        self.retries = 0  # calls retried on another replica since start
        self.metrics = metrics
        self.kv_destination = kv_destination
        self.kv_keys = kv_keys
        self.transfer_quiesce_s = transfer_quiesce_s
        self.router = PrefixRouter(policy)
        self.tracing = tracing  # common.tracing.Tracing or None
        self.traces: dict[str, tuple] = {}  # rid -> (its generate span's context, submission ns), set by the server
        if prefill_discovery.has_dns(self.entries):
            threading.Thread(
                target=self._rediscover, args=(resolve_interval_s,), name="prefill-discovery", daemon=True
            ).start()

    def __call__(self, request: HandoffRequest) -> None:
        with self._lock:
            self._active.add(request.rid)
            if self._early_cancel.pop(request.rid, False):  # aborted before the scheduler called us
                self._cancelled.add(request.rid)
        self._pool.submit(self._run, request)

    def any_serving(self, fresh: bool = False) -> bool:
        """Whether a replica serves; `fresh` asks every replica at once over new channels."""
        if not fresh:
            return any(p.serving() for p in self.peers)
        return any(self._pool.map(lambda p: p.serving(fresh=True), self.peers))

    def cancel(self, rid: str) -> None:
        with self._lock:
            if rid not in self._active:  # the scheduler may still call us for it: remember (bounded)
                self._early_cancel[rid] = True
                while len(self._early_cancel) > 4096:
                    self._early_cancel.pop(next(iter(self._early_cancel)))
                return
            self._cancelled.add(rid)
            call = self._calls.get(rid)
        if call is not None:
            call[0].cancel()

    def peer_of(self, rid: str) -> str | None:
        """The replica a request's prefill call is streaming from right now (for tests and logs)."""
        with self._lock:
            call = self._calls.get(rid)
        return call[1].address if call else None

    def refresh_peers(self) -> None:
        """Re-resolve the dns entries: new replicas take calls from now on, vanished ones none."""
        addresses = prefill_discovery.expand(self.entries)
        with self._lock:
            current = {p.address: p for p in self.peers}
            self.peers = [current.get(a) or _Peer(a, *self._peer_args) for a in addresses]  # one assignment
            gone = [p for a, p in current.items() if a not in addresses]
            self._retired.extend(gone)
        added = sorted(set(addresses) - set(current))
        if added or gone:
            logger.info("prefill replicas: %s joined, %s left", added, [p.address for p in gone])

    def _rediscover(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                self.refresh_peers()
            except Exception:  # noqa: BLE001 - keep the replicas we have
                logger.exception("re-resolving the prefill addresses failed")

    def _watchdog(self) -> None:
        while not self._closed.wait(min(0.25, self.progress_timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                stale = [
                    (rid, c[0])
                    for rid, c in self._calls.items()
                    if c[2] is not None and now - c[2] > self.progress_timeout_s
                ]
                self._stalled.update(rid for rid, _ in stale)
            for _rid, call in stale:
                call.cancel()

    def _progress(self, rid: str) -> None:
        with self._lock:
            if rid in self._calls:
                self._calls[rid][2] = time.monotonic()

    def close(self) -> None:
        """Cancel every call in flight (no retries), stop the workers, close the channels."""
        self._closed.set()
        with self._lock:
            self._cancelled.update(self._active)
            calls = [c[0] for c in self._calls.values()]
        for call in calls:
            call.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in self.peers + self._retired:
            p.channel.close()

    def _pick(self, exclude: set[str], prompt: list[int]) -> _Peer | None:
        deadline = time.monotonic() + self.wait_ready_s
        while True:
            ready = [p for p in self.peers if p.address not in exclude and p.serving()]
            if ready:
                replies = {p.address: p.load() for p in ready}  # RPCs outside the lock
                with self._lock:
                    loads = {p.address: replies[p.address][0] + p.in_flight for p in ready}
                    for address, (_, pool) in replies.items():
                        self.router.set_capacity(address, pool)
                    address = self.router.choose(loads, prompt)
                    peer = next(p for p in ready if p.address == address)
                    peer.in_flight += 1
                return peer
            if time.monotonic() >= deadline or len(exclude) == len(self.peers):
                return None
            time.sleep(0.2)

    def _run(self, request: HandoffRequest) -> None:
        sink, tried, sent, errors = self.sink, set(), [], []
        parent, submitted = self.traces.get(request.rid, (None, None))
        if parent is not None:
            self.tracing.record("queue", parent, submitted, time.time_ns())
        try:
            while True:
                peer = self._pick(tried, request.prompt_ids)
                if peer is None:
                    reason = "; ".join(errors) if errors else f"none serving within {self.wait_ready_s:.0f}s"
                    sink.fail_handoff(request.rid, f"no prefill replica left: {reason}")
                    return
                tried.add(peer.address)
                attempt = HandoffRequest(
                    request.rid,
                    request.prompt_ids + sent,
                    request.params,
                    request.seed,
                    first_position=len(sent),
                    kv_slots=request.kv_slots,
                )
                span = self.tracing.start("prefill_call", parent, replica=peer.address) if parent is not None else None
                carried = self.tracing.inject(self.tracing.context_of(span)) if span is not None else ()
                try:
                    handoff = self._stream(peer, attempt, sent, carried)
                except (grpc.RpcError, ValueError) as e:
                    if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        sink.fail_handoff(request.rid, f"{REFUSED}prefill replica {peer.address}: {e.details()}")
                        return  # every replica would refuse it too: no retry
                    detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
                    with self._lock:
                        cancelled = request.rid in self._cancelled
                        if request.rid in self._stalled:
                            self._stalled.discard(request.rid)
                            detail = f"no progress for {self.progress_timeout_s:g}s"
                    errors.append(f"{peer.address}: {detail}")
                    if self.kv_destination is not None:  # a write of this attempt may still be landing
                        time.sleep(self.transfer_quiesce_s)
                    if cancelled:  # aborted by the front door; a no-op if the scheduler already freed it
                        sink.fail_handoff(request.rid, "cancelled")
                        return
                    logger.warning(
                        "prefill of %s on %s broke (%s); retrying elsewhere", request.rid, peer.address, detail
                    )
                    self.retries += 1
                    if self.metrics is not None:
                        self.metrics.retries.inc()
                    continue
                finally:
                    if span is not None:
                        span.end()
                    with self._lock:
                        peer.in_flight -= 1
                        self._calls.pop(request.rid, None)
                sink.deliver_handoff(handoff)
                return
        except Exception as e:  # never leave a reservation without an answer
            logger.exception("prefill client failed for %s", request.rid)
            sink.fail_handoff(request.rid, f"prefill client error: {e!r}")
        finally:
            with self._lock:
                self._cancelled.discard(request.rid)
                self._stalled.discard(request.rid)
                self._active.discard(request.rid)

    def _stream(self, peer: _Peer, request: HandoffRequest, sent: list[int], trace_metadata: tuple = ()) -> Handoff:
        """One attempt. Tokens sampled by prefill are appended to `sent` as they are forwarded."""
        msg = prefill_request.build(
            request, self.max_chunk_bytes, self.kv_destination, self.kv_keys, self.call_timeout_s
        )
        call = peer.stub.Prefill(msg, timeout=self.call_timeout_s, metadata=peer.metadata + trace_metadata)
        with self._lock:
            self._calls[request.rid] = [call, peer, None]
            if request.rid in self._cancelled:
                call.cancel()
        cfg, draft, n = self.config, self.draft_config, len(request.prompt_ids)
        assembler = KvAssembler(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, store=False)
        draft_assembler = KvAssembler(n, 1, draft.num_kv_heads, draft.head_dim, store=False) if draft else None
        first, started, nbytes, handoff = None, None, 0, None
        window = threading.Semaphore(MAX_PENDING_CHUNKS)  # chunks delivered but not yet written
        for chunk in call:
            self._progress(request.rid)
            started = started or time.perf_counter()
            kind = chunk.WhichOneof("payload")
            if handoff is not None:  # the record comes last: anything after it is a broken stream
                raise ValueError(f"prefill stream sent {kind or 'an empty message'} after its record")
            if kind == "first_token":
                if first is not None:
                    raise ValueError("prefill stream sent a second first token")
                check_token(request.rid, "first token", chunk.first_token.token_id, cfg.vocab_size)
                first = chunk.first_token.token_id
                if len(sent) == request.first_position:
                    sent.append(first)
                self.sink.deliver_first_token(request.rid, first, request.first_position)
            elif kind == "kv":
                if chunk.kv.draft and draft_assembler is None:
                    raise ValueError("draft KV from a prefill replica, but speculative decoding is off here")
                k, v = (draft_assembler if chunk.kv.draft else assembler).add(chunk.kv)
                nbytes += kv_chunks.payload_bytes(chunk.kv)
                if not window.acquire(timeout=self.progress_timeout_s):  # gRPC flow control holds upstream
                    raise ValueError(f"decode took no KV chunk for {self.progress_timeout_s:g}s")
                self.sink.deliver_kv(
                    request.rid, chunk.kv.token_start, chunk.kv.layer_start, k, v, chunk.kv.draft, window.release
                )
            elif kind == "written":  # the replica wrote this KV into our slots: check the coverage
                w = chunk.written
                if w.draft and draft_assembler is None:
                    raise ValueError("draft KV from a prefill replica, but speculative decoding is off here")
                (draft_assembler if w.draft else assembler).cover(
                    w.token_start, w.num_tokens, w.layer_start, w.num_layers
                )
                nbytes += w.bytes
            elif kind == "record":
                rec = chunk.record
                assembler.finish()
                chunks = assembler.chunks
                if draft_assembler is not None:  # the head's KV must cover the prompt too
                    draft_assembler.finish()
                    chunks += draft_assembler.chunks
                if rec.prompt_len != n or rec.num_kv_chunks != chunks:
                    raise ValueError(
                        f"record says {rec.prompt_len} tokens / {rec.num_kv_chunks} chunks, got {n} / {chunks}"
                    )
                if first is not None and rec.first_token != first:
                    raise ValueError("record's first token differs from the streamed one")
                if self.metrics is not None:
                    elapsed = time.perf_counter() - started
                    self.metrics.observe_transfer(elapsed, nbytes)
                    self.metrics.handoff_bytes.inc(nbytes)
                handoff = Handoff(
                    request.rid,
                    request.prompt_ids,
                    request.params,
                    request.seed,
                    rec.first_token,
                    k=None,
                    v=None,
                    first_position=request.first_position,
                    cached_tokens=rec.cached_tokens,
                    **decode_seed(rec),
                )
                handoff.check_record(cfg.vocab_size)
                if draft is not None:
                    handoff.check_draft(cfg.hidden_size, cfg.vocab_size)
            else:
                raise ValueError(f"prefill stream sent an unknown message ({kind or 'empty'})")
        if handoff is None:
            raise ValueError("prefill stream ended without a record")
        return handoff
