"""The Mooncake transfer engine as this project's KV data plane: prefill writes K and V straight into
the decode side's reserved slots; the gRPC stream only carries notices (`KvWritten`).

- decode: `TransferEngine(host, ...)` at start-up, `register` its KV pools once (they are never
  reallocated), and name in each Prefill call the destination: `kv_region(pool)` per pool and
  `slot_runs(slots)` for the request's reserved slots (contiguous slots coalesced);
- prefill: its own engine; `register` a handoff's host KV, `write_plan` the (source, destination,
  length) triples of one chunk (tokens x layers) and `write` them in one batch; a notice follows.
The engine's P2P handshake needs no metadata server: a session is the peer's "host:rpc_port".
With an internal API key decode signs each destination (session, regions, slot runs) and prefill
writes only those that verify (common/wire/kv_capability.py): a caller cannot aim prefill at other
slots or at another engine. The engine itself authenticates nobody: the pinned wheel
(mooncake-transfer-engine-non-cuda 0.3.13.post1) listens on every interface whatever host it is given
(its handshake port on 0.0.0.0, its TCP transport on all addresses; checked), and serves reads and
writes of registered memory to any peer, so its hosts' network must be private to the two services.
Protocol "tcp" works on any host; "rdma" (with `device`, e.g. "mlx5_0") is for GPU nodes, where
registering device memory lets the engine use GPUDirect.
"""

from __future__ import annotations

import socket

import torch

from common.wire.kv_capability import Verifier
from common.wire.proto_gen import prefill_pb2

INSTALL_HINT = (
    "the mooncake transfer engine is not installed or cannot load: on a CPU host "
    "`pip install mooncake-transfer-engine-non-cuda` and `apt-get install libibverbs1` (Debian), on a GPU node "
    "`pip install mooncake-transfer-engine`; or use --disaggregation-transfer-backend grpc"
)


MAX_BATCH = 1024  # pieces per batch of writes


class MooncakeUnavailable(RuntimeError):
    """The engine cannot be loaded here (the message says what to install)."""


class TransferFailed(RuntimeError):
    """A batch of writes did not complete."""


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
        self._key = capability_key
        self.capabilities = Verifier()

    def capability_key(self, session: str) -> bytes | None:
        """The key a destination at `session` is signed with (the same for every decode side), or None."""
        return self._key

    def register(self, tensors: list[torch.Tensor]) -> None:
        """Register the memory of contiguous tensors (a pool's layers, or a handoff's KV)."""
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


def kv_region(k: list[torch.Tensor], v: list[torch.Tensor]) -> prefill_pb2.KvRegion:
    """A pool's per-layer K and V tensors [num_slots + 1, kv_heads, head_dim] as a destination."""
    slot_bytes = k[0][0].numel() * k[0].element_size()
    return prefill_pb2.KvRegion(
        k_ptrs=[t.data_ptr() for t in k], v_ptrs=[t.data_ptr() for t in v], slot_bytes=slot_bytes
    )


def slot_runs(slots: list[int]) -> list[prefill_pb2.SlotRun]:
    """Token i -> slots[i], as runs of consecutive slots."""
    runs: list[prefill_pb2.SlotRun] = []
    for i, slot in enumerate(slots):
        last = runs[-1] if runs else None
        if last is not None and last.slot + last.length == slot:
            last.length += 1
        else:
            runs.append(prefill_pb2.SlotRun(token_start=i, slot=slot, length=1))
    return runs


def check_destination(
    dest: prefill_pb2.KvDestination, region, prompt_len: int, num_layers: int, slot_bytes: int
) -> None:
    """ValueError unless the destination covers every prompt token once and `region` (one of its
    pools) matches the KV's layout."""
    covered = 0
    for run in dest.runs:
        if run.token_start != covered or run.length == 0:
            raise ValueError("kv_destination runs must cover the prompt's tokens in order")
        covered += run.length
    if covered != prompt_len:
        raise ValueError(f"kv_destination covers {covered} tokens, the prompt has {prompt_len}")
    if len(region.k_ptrs) != num_layers or len(region.v_ptrs) != num_layers or region.slot_bytes != slot_bytes:
        raise ValueError(
            f"kv_destination has {len(region.k_ptrs)} layers of {region.slot_bytes}-byte slots, "
            f"this model {num_layers} of {slot_bytes}"
        )


def write_plan(
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    region: prefill_pb2.KvRegion,
    runs,
    token_start: int,
    num_tokens: int,
    layer_start: int,
    num_layers: int,
) -> tuple[list[int], list[int], list[int]]:
    """(sources, destinations, lengths) that write tokens [token_start, +num_tokens) of layers
    [layer_start, +num_layers) from host KV (per layer [prompt_len, kv_heads, head_dim], contiguous)
    into the region's slots."""
    size = region.slot_bytes
    srcs, dsts, lens = [], [], []
    end = token_start + num_tokens
    for run in runs:
        lo = max(token_start, run.token_start)
        hi = min(end, run.token_start + run.length)
        if lo >= hi:
            continue
        slot = run.slot + (lo - run.token_start)
        for layer in range(layer_start, layer_start + num_layers):
            for src, base in ((k[layer], region.k_ptrs[layer]), (v[layer], region.v_ptrs[layer])):
                srcs.append(src.data_ptr() + lo * size)
                dsts.append(base + slot * size)
                lens.append((hi - lo) * size)
    return srcs, dsts, lens
