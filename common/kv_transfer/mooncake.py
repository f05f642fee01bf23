"""The Mooncake backend (--disaggregation-transfer-backend mooncake): prefill writes K and V straight
into the decode side's reserved slots through the Mooncake transfer engine; the gRPC stream carries
only notices (`KvWritten`). The engine-neutral parts are address_writes.py and plan.py.

- decode (`MooncakeReceiver`): a `TransferEngine` at start-up with its KV pools registered once
  (they are never reallocated); every call names the engine's session and the pools' addresses;
- prefill (`MooncakeSender`): its own engine; it registers a handoff's KV, writes each chunk in one
  batch and unregisters it. The KV is staged where the pool is (`staging_device`), so on CUDA the
  scheduler thread never waits for a copy to the host. Over RDMA the CUDA build registers that
  device memory and the NIC reads it (GPUDirect: no host copy at all). Over TCP the engine would
  copy every piece off the device by itself, which measured slower on an H100 (scattered slot runs
  0.29 against 0.40 GB/s) than one pinned copy per layer on the transfer thread, so TCP gets that.
The engine's P2P handshake needs no metadata server: a session is the peer's "host:rpc_port".
With an internal API key decode signs each destination (session, regions, slot runs) and prefill
writes only those that verify (common/wire/kv_capability.py): a caller cannot aim prefill at other
slots or at another engine. The engine itself authenticates nobody: the pinned wheel
(mooncake-transfer-engine-non-cuda 0.3.13.post1) listens on every interface whatever host it is given
(its handshake port on 0.0.0.0, its TCP transport on all addresses; checked), and serves reads and
writes of registered memory to any peer, so its hosts' network must be private to the two services.
Protocol "tcp" works on any host; "rdma" (with `device`, e.g. "mlx5_0") is for GPU nodes.
"""

from __future__ import annotations

import logging
import socket

import torch

from common.kv_transfer.address_writes import AddressSender, PoolReceiver
from common.kv_transfer.errors import KvTransferError
from common.wire import kv_capability
from common.wire.kv_capability import Verifier

logger = logging.getLogger(__name__)
LABEL = "mooncake"
INSTALL_HINT = (
    "the mooncake transfer engine is not installed or cannot load: on a CPU host "
    "`pip install mooncake-transfer-engine-non-cuda` and `apt-get install libibverbs1` (Debian), on a GPU node "
    "`pip install mooncake-transfer-engine`; or use --disaggregation-transfer-backend grpc"
)
MAX_BATCH = 1024  # pieces per batch of writes


class MooncakeUnavailable(RuntimeError):
    """The engine cannot be loaded here (the message says what to install)."""


class TransferFailed(KvTransferError):
    """A registration or a batch of writes did not complete."""


def available() -> str | None:
    """None if the engine loads here, else why not (with what to install)."""
    try:
        from mooncake.engine import TransferEngine as _  # noqa: F401
    except (ImportError, OSError) as e:
        return f"{INSTALL_HINT} ({e})"
    return None


def require() -> None:
    """Raise MooncakeUnavailable (saying what to install) unless the engine loads here."""
    reason = available()
    if reason is not None:
        raise MooncakeUnavailable(reason)


def require_private_network(config) -> None:
    """ValueError unless the operator has said the network between the services is private. The engine
    (mooncake-transfer-engine 0.3.13, and its source today) binds its handshake and data listeners to
    every interface whatever --host says, and serves registered memory to any peer that reaches them: a
    review's engine holding no key read 64 KiB of another request's KV out of decode's pool and
    overwrote it. It cannot be confined from here, so it runs only where the operator confined it."""
    if not config.disaggregation_network_private:
        raise ValueError(
            "--disaggregation-transfer-backend mooncake: the Mooncake engine listens on every interface "
            "whatever --host says and serves registered KV memory to any peer that reaches it; pass "
            "--disaggregation-network-private once only the two services can reach each other's engine "
            "(compose: a network without the gateway; k8s: deploy/k8s/network.yaml), or use grpc or shm"
        )


class TransferEngine:
    def __init__(
        self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "", capability_key: bytes | None = None
    ):
        """`capability_key` (prefill: kv_capability.key_from_internal of the internal API key): the key
        that destinations' capabilities must verify with; None writes unsigned destinations."""
        require()
        from mooncake.engine import TransferEngine as Engine

        self._engine = Engine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise MooncakeUnavailable(f"mooncake engine failed to start on {host} ({protocol}, device {device!r})")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self.protocol = protocol
        self._key = capability_key
        self.capabilities = Verifier()

    def capability_key(self, session: str) -> bytes | None:
        """The key a destination at `session` is signed with (the same for every decode side), or None."""
        return self._key

    def register(self, tensors: list[torch.Tensor]) -> None:
        """Register the memory of contiguous tensors (a pool's layers, or a handoff's KV), host or device."""
        ptrs, lens = _spans(tensors)
        if ptrs and self._engine.batch_register_memory(ptrs, lens) != 0:
            raise TransferFailed(f"registering {len(ptrs)} buffers failed")

    def unregister(self, tensors: list[torch.Tensor]) -> None:
        ptrs, _ = _spans(tensors)
        if ptrs:
            self._engine.batch_unregister_memory(ptrs)

    def write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Write local registered memory into the peer's registered memory; returns once it landed.
        In batches of at most MAX_BATCH pieces (the engine refuses a batch of 4096)."""
        for i in range(0, len(srcs), MAX_BATCH):
            part = slice(i, i + MAX_BATCH)
            if self._engine.batch_transfer_sync_write(session, srcs[part], dsts[part], lens[part]) != 0:
                raise TransferFailed(f"writing {sum(lens[part])} bytes to {session} failed")


def advertised_host(bind_host: str) -> str:
    """The address peers reach this engine at: the bind host, or this host's name when bound to all."""
    if bind_host in ("", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return bind_host


def _spans(tensors: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """(start, length) of the memory of the tensors, adjacent pieces merged into one span (a pool's
    or a handoff's layers are views of one buffer: one registration, not one per layer)."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
    pieces = sorted({(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()})
    ptrs: list[int] = []
    lens: list[int] = []
    for ptr, n in pieces:
        if ptrs and ptrs[-1] + lens[-1] >= ptr:  # touches or overlaps the previous span
            lens[-1] = max(lens[-1], ptr + n - ptrs[-1])
        else:
            ptrs.append(ptr)
            lens.append(n)
    return ptrs, lens


def is_session(session: str) -> bool:
    """Whether `session` names an engine ("host:port"; an IPv6 host keeps its colons)."""
    host, sep, port = session.rpartition(":")
    return bool(host and sep and port.isdigit())


class MooncakeSender(AddressSender):
    label = LABEL

    def __init__(self, transfer_engine: TransferEngine | None):
        self.transfer_engine = transfer_engine
        # RDMA reads device memory where it is (GPUDirect); the TCP transport would copy each piece
        # off the device by itself, slower than one copy per layer on the transfer thread (measured)
        self.reads_device = transfer_engine is not None and transfer_engine.protocol == "rdma"

    @property
    def writer(self) -> TransferEngine | None:
        """What AddressSender writes through: the transfer engine."""
        return self.transfer_engine

    @classmethod
    def from_config(cls, config) -> MooncakeSender:
        require_private_network(config)
        key = kv_capability.key_from_internal(config.internal_api_key)  # signed destinations only
        transfer_engine = TransferEngine(
            advertised_host(config.host), config.disaggregation_protocol, config.disaggregation_ib_device, key
        )
        if key is None:
            logger.warning(
                "mooncake without --internal-api-key: KV destinations are unsigned, so any caller of this "
                "port can aim the KV writes; keep it on the private network of the Mooncake engines"
            )
        return cls(transfer_engine)

    def staging_device(self, pool_device) -> torch.device:
        """The pool's device: the copy-out never waits for the device on the scheduler thread, and
        over RDMA the engine registers that memory as it is (no host copy on CUDA)."""
        return torch.device(pool_device)

    def reaches(self, dest) -> bool:
        """Every target is an engine's session (a shared-memory session, say, gets bytes)."""
        return all(is_session(r.session) for r in kv_capability.ranks(dest))


class MooncakeReceiver(PoolReceiver):
    @staticmethod
    def check(config) -> None:
        require_private_network(config)
        require()

    @classmethod
    def from_config(cls, runner, config) -> MooncakeReceiver:
        transfer_engine = TransferEngine(
            advertised_host(config.host), config.disaggregation_protocol, config.disaggregation_ib_device
        )
        return cls(runner, transfer_engine, kv_capability.key_from_internal(config.internal_api_key))
