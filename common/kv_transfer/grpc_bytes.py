"""The gRPC bytes backend (--disaggregation-transfer-backend grpc, and every other backend's fallback).

Sender: the handoff's KV travels on the Prefill stream itself as bounded `KvChunk` messages (the
wire codec: common/wire/kv_chunks.py; K and V one tensor each over a chunk's layers), the EAGLE
head's after the target's. It needs host tensors: a handoff staged on a device (for Mooncake) that
falls back to bytes is copied to the host here, on the transfer thread, once its copy-out is done.
Receiver: nothing to set up; decode names no destination. The decode side checks and writes
arriving chunks whatever backend it runs (decode_service/prefill_stream.py and handoff_writes.py),
because a decode side with Mooncake or shm still takes bytes from a replica that cannot reach it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from common.kv_transfer import staging
from common.kv_transfer.errors import as_transfer_errors
from common.wire import kv_chunks
from common.wire.proto_gen import prefill_pb2

LABEL = "grpc"


def kv_messages(handoff, max_bytes: int) -> Iterator[prefill_pb2.PrefillChunk]:
    """The KV itself as bounded KvChunks (the head's after the target's). Lazy: the wait for the
    copy-out and any host copy happen at the first message, on the thread that takes it."""
    handoff = staging.host_handoff(handoff)
    yield from kv_chunks.split(handoff.k, handoff.v, max_bytes)
    if handoff.draft_k is not None:
        yield from kv_chunks.split(handoff.draft_k, handoff.draft_v, max_bytes, draft=True)


class BytesSender:
    """The prefill side: reaches no destination, sends every handoff as bytes from host memory."""

    label = LABEL

    @classmethod
    def from_config(cls, config) -> BytesSender:
        return cls()

    def staging_device(self, pool_device) -> torch.device:
        return staging.HOST

    def reaches(self, dest) -> bool:
        return False

    def messages(
        self, request_id: str, dest, handoff, max_bytes: int, cancelled: Callable[[], bool]
    ) -> tuple[str, Iterator[prefill_pb2.PrefillChunk]]:
        return LABEL, as_transfer_errors(kv_messages(handoff, max_bytes))

    def close(self) -> None:
        pass


class BytesReceiver:
    """The decode side: no pools to register, no destination to name, no keys."""

    destination = None
    keys = None
    writes_late = False  # decode writes the chunks itself, before the call's record

    def settle(self) -> None:
        pass

    @staticmethod
    def check(config) -> None:
        pass

    @staticmethod
    def pool_memory(config) -> None:
        return None

    @classmethod
    def from_config(cls, runner, config) -> BytesReceiver:
        return cls()
