"""TPGroup: the ranks one service's model is split across, and the collectives the model and the
rank-0-leads protocol need.

1. `TPGroup.init(rank, size, "tcp://HOST:PORT", device)`: rank 0 hosts a TCPStore there; every rank
   joins a gloo group (control messages, and the tensors on CPU) and on CUDA an NCCL group (tensors).
   The groups are the service's own objects, not torch.distributed's process-wide default: two
   services in one process (tests) each keep their own. `TPGroup.single()` is TP 1: every collective
   is the identity.
2. `all_reduce(x)`: the sum over ranks of row-parallel partial results (after attention's o_proj
   and the MLP's down_proj), in place.
3. `all_gather_last(x)` / `all_gather(x)`: shards concatenated on the last dim (the vocabulary-
   parallel lm_head's logits: every rank holds the same logits and samples the same token) / every
   rank's tensor, in rank order.
4. `broadcast_object(obj)` / `scatter_object(parts)`: rank 0's Python objects to every rank, the same
   one or one each (a decode rank's part of a KV handoff), serialized with torch.save and loaded
   onto the receiving rank's device.
Collectives block until every rank joins: a rank that dies makes the others fail (gloo: the peer's
socket closes), or time out after `timeout_s`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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

    @classmethod
    def single(cls) -> TPGroup:
        return cls()

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, device: str = "cpu", timeout_s: float = 60.0) -> TPGroup:
        if not 0 <= rank < size:
            raise ValueError(f"--tp-rank must be in [0, {size}), got {rank}")
        if size == 1:
            return cls.single()
        host, port = _parse(init_method)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        dev = torch.device(device)
        group = cpu
        if dev.type == "cuda":
            torch.cuda.set_device(rank)  # one GPU per rank of this host
            dev = torch.device("cuda", rank)
            group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
        return cls(rank, size, cpu, group, dev, store)

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
    def _bcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.cpu.broadcast([t], opts).wait()

    def broadcast_object(self, obj=None):
        if self.size == 1:
            return obj
        data = _dump(obj) if self.rank == 0 else None
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._bcast(n)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data is not None
            else torch.empty(int(n), dtype=torch.uint8)
        )
        self._bcast(buf)
        return obj if self.rank == 0 else _load(buf, self.device)

    def all_gather_object(self, obj) -> list:
        """Every rank's object, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        data = _dump(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.cpu.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        width = int(max(s.item() for s in sizes))
        mine = torch.frombuffer(bytearray(data) + bytearray(width - len(data)), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        self.cpu.allgather([parts], [mine]).wait()
        return [_load(p[: int(n)], self.device) for p, n in zip(parts, sizes)]

    def scatter_object(self, parts: list | None = None):
        """Rank 0 passes one object per rank and gets its own; the others pass None and get theirs."""
        if self.size == 1:
            return parts[0]
        sizes = torch.zeros(self.size, dtype=torch.int64)
        blobs = None
        if self.rank == 0:
            blobs = [_dump(p) for p in parts]
            sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
        self._bcast(sizes)
        width = int(sizes.max())
        out = torch.empty(width, dtype=torch.uint8)
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        inputs = []
        if self.rank == 0:
            padded = [bytearray(b) + bytearray(width - len(b)) for b in blobs]
            inputs = [[torch.frombuffer(p, dtype=torch.uint8) for p in padded]]
        self.cpu.scatter([out], inputs, opts).wait()
        return parts[0] if self.rank == 0 else _load(out[: int(sizes[self.rank])], self.device)

    def close(self) -> None:
        self.cpu = self.device_group = self.store = None  # the groups end with their last reference


def _dump(obj) -> bytes:
    f = io.BytesIO()
    torch.save(obj, f)
    return f.getvalue()


def _load(buf: torch.Tensor, device: torch.device):
    return torch.load(io.BytesIO(buf.numpy().tobytes()), map_location=device, weights_only=False)
