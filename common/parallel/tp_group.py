"""TPGroup: the ranks one service's model is split across, on torch.distributed (gloo on CPU, NCCL on
CUDA), and the three collectives the model needs.

1. `TPGroup.init(rank, size, init_method, device)` joins the group (every rank of the service calls
   it with the same `init_method`, e.g. tcp://127.0.0.1:PORT); `TPGroup.single()` is TP 1 and
   every collective is the identity.
2. `all_reduce(x)`: the sum over ranks of row-parallel partial results (after attention's o_proj
   and the MLP's down_proj), in place.
3. `all_gather_last(x)`: shards concatenated on the last dim in rank order (the vocabulary-parallel
   lm_head's logits): every rank holds the same full logits, so every rank samples the same token.
4. `broadcast_object(obj)` / `scatter_object(parts)`: rank 0's Python objects to every rank, the
   same one or one each (control messages; a decode rank's part of a KV handoff).
Collectives block until every rank joins: a rank that died makes the others fail, not hang, once
the group's timeout passes (`timeout_s`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None

    @classmethod
    def single(cls) -> TPGroup:
        return cls()

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, device: str = "cpu", timeout_s: float = 60.0) -> TPGroup:
        if not 0 <= rank < size:
            raise ValueError(f"--tp-rank must be in [0, {size}), got {rank}")
        if size == 1:
            return cls.single()
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank of this host
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                    timeout=timedelta(seconds=timeout_s))  # fmt: skip
        return cls(rank, size, dist.group.WORLD)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj=None):
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def scatter_object(self, parts: list | None = None):
        """Rank 0 passes one object per rank and gets its own; the others pass None and get theirs."""
        if self.size == 1:
            return parts[0]
        box = [None]
        dist.scatter_object_list(box, parts if self.rank == 0 else None, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
