"""The sender role of the KV transport: how a prefill replica hands one handoff's KV to decode.

One sender per prefill service, made by `make_sender(config)` from
--disaggregation-transfer-backend (the only place that tells the backends apart on this side):

    sender.staging_device(pool_device) -> torch.device
        where the prefill worker's copy-out of a finished prompt's KV should land: host memory for gRPC
        bytes and shm, the pool's device for Mooncake (staging.py);
    sender.reaches(dest) -> bool
        whether this replica can write into that destination itself;
    sender.messages(request_id, dest or None, handoff, max_bytes, cancelled) -> (label, messages)
        the KV part of one Prefill stream: KvWritten notices after writes into decode's slots when
        the call names a destination this sender reaches, else the KV itself as KvChunk bytes (the
        fallback of every backend); `label` names what was used (the metrics' backend label). The
        messages are lazy and block: take them on a transfer thread. Whatever goes wrong while they
        are made is a KvTransferError (errors.py), one type for the server to catch;
    sender.close()
        let go of what the backend holds (maps, not decode's memory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from common.kv_transfer import grpc_bytes, mooncake, shm
from common.wire.proto_gen import prefill_pb2

_SENDERS = {
    grpc_bytes.LABEL: grpc_bytes.BytesSender,
    mooncake.LABEL: mooncake.MooncakeSender,
    shm.LABEL: shm.ShmSender,
}


class KvSender(Protocol):
    label: str

    def staging_device(self, pool_device) -> torch.device: ...

    def reaches(self, dest: prefill_pb2.KvDestination) -> bool: ...

    def messages(
        self,
        request_id: str,
        dest: prefill_pb2.KvDestination | None,
        handoff,
        max_bytes: int,
        cancelled: Callable[[], bool],
    ) -> tuple[str, Iterator[prefill_pb2.PrefillChunk]]: ...

    def close(self) -> None: ...


def make_sender(config) -> KvSender:
    """The sender of `config.disaggregation_transfer_backend`. Call it before the model loads: a
    backend that cannot work here (an engine that does not load) says so at once, with what to install."""
    try:
        backend = _SENDERS[config.disaggregation_transfer_backend]
    except KeyError:
        raise ValueError(f"unknown KV transfer backend {config.disaggregation_transfer_backend!r}") from None
    return backend.from_config(config)
