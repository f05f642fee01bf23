"""TPGroup: the ranks one service's model is split across, and the collectives the model and the
rank-0-leads protocol need.

1. `TPGroup.init(rank, size, "tcp://HOST:PORT", device, key=...)`: rank 0 hosts a TCPStore there
   (listening on HOST only); every rank proves the launch's key, then joins a gloo group bound to HOST
   (a rank on another node: its own address) for control messages and the tensors on CPU, and on
   CUDA an NCCL group (tensors, met over the store at once); then the store takes no new connection.
   What the key guards, and how: common/parallel/tp_auth.py.
   The groups are the service's own objects, not torch.distributed's process-wide default: two
   services in one process (tests) each keep their own. `TPGroup.single()` is TP 1: every collective
   is the identity.
2. `all_reduce(x)`: the sum over ranks of row-parallel partial results (after attention's o_proj
   and the MLP's down_proj), in place.
3. `all_gather_last(x)` / `all_gather(x)`: shards concatenated on the last dim (the vocabulary-
   parallel lm_head's logits: every rank holds the same logits and samples the same token) / every
   rank's tensor, in rank order.
4. `broadcast_object(obj)` / `scatter_object(parts)`: rank 0's Python objects to every rank, the same
   one or one each (a decode rank's part of a KV handoff): tensors and plain data only (no pickled
   code), each message tagged with the key, loaded onto the receiving rank's device.
Collectives block until every rank joins: a rank that dies makes the others fail (gloo: the peer's
socket closes), or time out after `timeout_s`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from common.parallel import tp_auth, tp_codec

IDLE_TIMEOUT = timedelta(days=365)  # a follower's wait for rank 0's next message: no timeout in effect


def _parse(init_method: str) -> tuple[str, int]:
    if not init_method.startswith("tcp://"):
        raise ValueError(f"the TP group address must be tcp://HOST:PORT, got {init_method!r}")
    host, _, port = init_method[len("tcp://") :].rpartition(":")
    return host, int(port)


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    cpu: object | None = None  # gloo ProcessGroup: control messages (and tensors on CPU)
    device_group: object | None = None  # NCCL ProcessGroup on CUDA, else the gloo one
    device: torch.device = torch.device("cpu")
    store: object | None = None
    key: bytes = field(default=b"", repr=False)  # the launch's key: tags every message
    sent: int = 0  # object messages so far (the same count on every rank): part of each tag

    @classmethod
    def single(cls) -> TPGroup:
        return cls()

    @classmethod
    def init(
        cls,
        rank: int,
        size: int,
        init_method: str,
        device: str = "cpu",
        timeout_s: float = 60.0,
        key: str = "",
        listener: socket.socket | None = None,
        bind_host: str | None = None,
        local_rank: int | None = None,
    ) -> TPGroup:
        """Join (rank 0: host) the group. `key`: the launch's secret (tp_auth.new_key()), the same on
        every rank. `listener`: rank 0's listening socket from tp_auth.listen (else it binds HOST:PORT
        itself); the group owns it from this call on, and closes it on failure. `bind_host`: where this
        rank's gloo listens (default HOST: a rank of another node passes its own address);
        `local_rank`: its device index on this host (default `rank`: every rank on one host)."""
        held = None
        try:
            if not 0 <= rank < size:
                raise ValueError(f"--tp-rank must be in [0, {size}), got {rank}")
            if size == 1:
                return cls.single()
            if not key:
                raise ValueError("a TP group of several ranks needs the launch's key (tp_auth.new_key()) on every rank")
            host, port = _parse(init_method)
            timeout = timedelta(seconds=timeout_s)
            if rank == 0:
                listener = listener or tp_auth.listen(host, port)
                port = listener.getsockname()[1]
                held = socket.socket(fileno=os.dup(listener.fileno()))  # to stop listening once formed
                # from here the store owns the socket: it closes it, also when it fails to start
                raw = dist.TCPStore(host, port, size, True, timeout, master_listen_fd=listener.detach())
            else:
                raw = dist.TCPStore(host, port, size, False, timeout)
        except BaseException:
            if held is not None:  # the store failed to start: the duplicate must not keep the port open
                tp_auth.stop_listening(held)
            raise
        finally:
            if listener is not None:
                listener.close()  # a no-op once detached
        try:
            return cls._form(rank, size, host, timeout, key, raw, device, bind_host, local_rank, held)
        finally:
            if held is not None:  # failed before joining: nobody else may connect either (a no-op if done)
                tp_auth.stop_listening(held)

    @classmethod
    def _form(cls, rank, size, host, timeout, key, raw, device, bind_host, local_rank, held=None) -> TPGroup:
        """Prove the key, then form the groups over the store's connections (every rank's made by now).
        `held`: rank 0's duplicate of the listening socket, shut once every rank joined: before the gloo
        group forms, which no other rank gets past before rank 0 writes its address, so no rank sees a
        formed group while the port still takes connections (shut after forming, a rank raced it)."""
        secret = key.encode()
        store = tp_auth.AuthStore(raw, secret)
        tp_auth.join(store, rank, size)
        if held is not None:
            tp_auth.stop_listening(held)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host or host)]
        cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, options)
        dev = torch.device(device)
        group = cpu
        if dev.type == "cuda":
            if _is_loopback(host):
                os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # NCCL's bootstrap on loopback too
            index = rank if local_rank is None else local_rank
            torch.cuda.set_device(index)  # one GPU per rank of this host
            dev = torch.device("cuda", index)
            group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
            group.allreduce([torch.zeros(1, device=dev)]).wait()  # NCCL meets over the store now, not lazily later
        return cls(rank, size, cpu, group, dev, store, secret)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.device_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [x]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x]).wait()
        return parts

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else torch.cat(self.all_gather(x), dim=-1)

    # ---- Python objects from rank 0 (the gloo group) ------------------------------------------------
    def _bcast(self, t: torch.Tensor, idle: bool = False) -> None:
        """`idle`: a follower waiting for rank 0's next message, however long the service idles (the
        group's timeout would end it after `timeout_s`); a dead rank 0 still fails it (socket closed)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if idle and self.rank != 0:
            opts.timeout = IDLE_TIMEOUT
        self.cpu.broadcast([t], opts).wait()

    def _label(self, src: int, dst: str) -> str:
        return f"msg/{self.sent}/{src}/{dst}"

    def _dump(self, obj, dst: str) -> bytearray:
        return tp_auth.seal(self.key, self._label(self.rank, dst), tp_codec.dumps(obj))

    def _load(self, buf: torch.Tensor, src: int, dst: str):
        # buf is this message's own receive buffer: its CPU tensors may keep it (no copy)
        return tp_codec.loads(tp_auth.unseal(self.key, self._label(src, dst), buf.numpy()), self.device)

    # Each method below is one message number on every rank: counted once its collective ran (a
    # sender's refusal to encode sends nothing and counts nothing).
    def broadcast_object(self, obj=None):
        if self.size == 1:
            return obj
        data = self._dump(obj, "all") if self.rank == 0 else None
        try:
            n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
            self._bcast(n, idle=True)
            buf = (
                torch.frombuffer(data, dtype=torch.uint8)
                if data is not None
                else torch.empty(int(n), dtype=torch.uint8)
            )
            self._bcast(buf)
            return obj if self.rank == 0 else self._load(buf, 0, "all")
        finally:
            self.sent += 1

    def all_gather_object(self, obj) -> list:
        """Every rank's object, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        data = self._dump(obj, "all")
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
            self.cpu.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
            width = int(max(s.item() for s in sizes))
            data += bytes(width - len(data))
            parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
            self.cpu.allgather([parts], [torch.frombuffer(data, dtype=torch.uint8)]).wait()
            return [self._load(p[: int(n)], r, "all") for r, (p, n) in enumerate(zip(parts, sizes))]
        finally:
            self.sent += 1

    def scatter_object(self, parts: list | None = None):
        """Rank 0 passes one object per rank and gets its own; the others pass None and get theirs."""
        if self.size == 1:
            return parts[0]
        sizes = torch.zeros(self.size, dtype=torch.int64)
        blobs = None
        if self.rank == 0:
            blobs = [self._dump(p, str(r)) for r, p in enumerate(parts)]
            sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
        try:
            self._bcast(sizes, idle=True)
            width = int(sizes.max())
            out = torch.empty(width, dtype=torch.uint8)
            opts = dist.ScatterOptions()
            opts.rootRank = 0
            inputs = []
            if self.rank == 0:
                for b in blobs:
                    b += bytes(width - len(b))
                inputs = [[torch.frombuffer(b, dtype=torch.uint8) for b in blobs]]
            self.cpu.scatter([out], inputs, opts).wait()
            return parts[0] if self.rank == 0 else self._load(out[: int(sizes[self.rank])], 0, str(self.rank))
        finally:
            self.sent += 1

    def close(self) -> None:
        self.cpu = self.device_group = self.store = None  # the groups end with their last reference


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
