"""One request's prefill call, attempted on replicas until one delivers its Handoff.

`ReplicaCall.run` (on a prefill-call worker thread) picks a replica not tried yet (prefill_replicas.py),
streams an attempt (`attempt`: the request built by prefill_request.py, read by prefill_stream.py), and
delivers the Handoff. An attempt that breaks (a gRPC error, a broken stream, the progress watchdog) is
retried on another replica by re-prefilling prompt + the tokens already sent (sampled at the next output
position), so the client never sees a token twice or changed. A refusal (INVALID_ARGUMENT) is not
retried: every replica would refuse it too. With no replica left, or once cancelled, it ends in exactly
one `fail_handoff`. A broken attempt is reported once the KV receiver has settled (a transfer engine's
write still landing cannot reach slots the scheduler has handed to another request, or a retry's).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from common.engine.handoff import HandoffRequest
from common.request_rules import ErrorKind
from decode_service import prefill_request
from decode_service.prefill_replicas import PREFILL_METHOD, Replica
from decode_service.prefill_stream import HandoffStream

if TYPE_CHECKING:
    from decode_service.prefill_client import PrefillClient

logger = logging.getLogger(__name__)


def attempt(client: PrefillClient, replica: Replica, request: HandoffRequest, sent: list[int], trace_metadata=()):
    """One attempt on `replica`. Tokens sampled by prefill are appended to `sent` as they are forwarded."""
    msg = prefill_request.build(
        request, client.max_chunk_bytes, client.kv_destination, client.kv_keys, client.call_timeout_s
    )
    metadata = replica.auth(PREFILL_METHOD) + trace_metadata
    call = replica.stub.Prefill(msg, timeout=client.call_timeout_s, metadata=metadata)
    client.calls.attach(request.rid, call, replica)
    stream = HandoffStream(
        request, sent, client.sink, client.config, client.draft_config, client.progress_timeout_s, client.metrics
    )
    for chunk in call:
        client.calls.progress(request.rid)
        stream.add(chunk)
    return stream.finish()


@dataclass
class ReplicaCall:
    """The state of one request's call across its attempts."""

    client: PrefillClient
    request: HandoffRequest
    tried: set[str] = field(default_factory=set)  # replica addresses attempted
    sent: list[int] = field(default_factory=list)  # tokens forwarded to the client so far
    errors: list[str] = field(default_factory=list)  # "address: why" for each broken attempt
    sink: object = field(init=False)  # where the call's outcome goes: the client's sink when it starts

    def __post_init__(self):
        self.sink = self.client.sink
        sent = self.request.first_position
        if sent:  # a retracted request (kv_growth.py): its outputs so far went out already, as a retry's
            prompt = self.request.prompt_ids
            self.sent = list(prompt[len(prompt) - sent :])
            self.request = dataclasses.replace(self.request, prompt_ids=prompt[: len(prompt) - sent], first_position=0)

    def run(self) -> None:
        client, rid = self.client, self.request.rid
        parent, submitted = self.request.trace or (None, None)  # the front door's generate span, if traced
        if parent is not None:
            client.tracing.record("queue", parent, submitted, time.time_ns())
        try:
            while True:
                replica = client.replicas.pick(self.tried, self.request.prompt_ids, client.wait_ready_s)
                if replica is None:
                    reason = (
                        "; ".join(self.errors) if self.errors else f"none serving within {client.wait_ready_s:.0f}s"
                    )
                    self.sink.fail_handoff(rid, f"no prefill replica left: {reason}")
                    return
                self.tried.add(replica.address)
                if self._attempt(replica, parent):
                    return
        except Exception as e:  # never leave a reservation without an answer
            logger.exception("prefill client failed for %s", rid)
            self.sink.fail_handoff(rid, f"prefill client error: {e!r}")
        finally:
            client.calls.end(rid)

    def _attempt(self, replica: Replica, parent) -> bool:
        """Whether the call is over (its Handoff delivered, or failed); False: retry elsewhere."""
        client, request = self.client, self.request
        attempt_request = HandoffRequest(
            request.rid,
            request.prompt_ids + self.sent,
            request.params,
            request.seed,
            first_position=len(self.sent),
            kv_slots=request.kv_slots,
            kv_start=request.kv_start,  # decode's prefix cache holds the KV before it (prefix_cache.py)
        )
        tracing = client.tracing
        span = tracing.start("prefill_call", parent, replica=replica.address) if parent is not None else None
        carried = tracing.inject(tracing.context_of(span)) if span is not None else ()
        try:
            handoff = client._stream(replica, attempt_request, self.sent, carried)  # tests wrap client._stream
        except (grpc.RpcError, ValueError) as e:
            return self._broke(replica, e)
        finally:
            if span is not None:
                span.end()
            client.replicas.release(replica)
            client.calls.detach(request.rid)
        self.sink.deliver_handoff(handoff)
        return True

    def _broke(self, replica: Replica, e: grpc.RpcError | ValueError) -> bool:
        """An attempt broke: whether the call is over (failed here); False: retry elsewhere."""
        client, rid = self.client, self.request.rid
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            self.sink.fail_handoff(
                rid, f"refused as invalid by prefill replica {replica.address}: {e.details()}", ErrorKind.REFUSED
            )
            return True  # every replica would refuse it too: no retry
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.FAILED_PRECONDITION and self.request.kv_start:
            detail = (
                f"prefill replica {replica.address} refused the KV from position {self.request.kv_start}: {e.details()}"
            )
            self.sink.fail_handoff(rid, detail, ErrorKind.KV_START_REFUSED)  # the scheduler asks for it whole
            return True
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
        cancelled, stalled = client.calls.broke(rid)
        if stalled:
            detail = f"no progress for {client.progress_timeout_s:g}s"
        self.errors.append(f"{replica.address}: {detail}")
        client.kv_receiver.settle()  # a write of this attempt may still be landing (transfer engines)
        if cancelled:  # aborted by the front door; a no-op if the scheduler already freed it
            self.sink.fail_handoff(rid, "cancelled")
            return True
        logger.warning("prefill of %s on %s broke (%s); retrying elsewhere", rid, replica.address, detail)
        client.retries += 1
        if client.metrics is not None:
            client.metrics.retries.inc()
        return False
