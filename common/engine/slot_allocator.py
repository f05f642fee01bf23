"""SlotAllocator: exact allocation of integer ids 1..size (id 0 is the padding id, never handed out).

Used for KV slots (token positions in the KV pools) and for request slots (ReqToTokenPool rows).
Frees are exact: freeing an id that is not owned (double free, never allocated, padding id) raises,
and `check_integrity` proves free + used == total with no id owned twice.
The free ids live on a preallocated stack: `alloc(n)` and `free(ids)` cost O(n), whatever the pool's
size, and an allocation is a copy of its own (it keeps no part of the free list alive). The last
freed ids are handed out first, in the order they were allocated, so a freed run of consecutive
slots comes back as the same run (a transfer engine writes a run as one piece).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class OutOfSlots(RuntimeError):
    """Not enough free ids for an allocation; nothing was allocated."""


class DoubleFree(RuntimeError):
    """A free named ids that are not currently owned; nothing was freed."""


class IntegrityError(AssertionError):
    """The allocator's books do not balance."""


class SlotAllocator:
    def __init__(self, size: int, name: str = "slots"):
        if size <= 0:
            raise ValueError(f"{name}: size must be positive, got {size}")
        self.size = size
        self.name = name
        self._stack = torch.arange(size, 0, -1, dtype=torch.int64)  # free ids; the top is handed out first
        self._top = size  # how many ids are free: _stack[:_top]
        self._owned = torch.zeros(size + 1, dtype=torch.bool)

    @property
    def _free(self) -> torch.Tensor:
        return self._stack[: self._top]

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.size - self.num_free

    def can_alloc(self, n: int) -> bool:
        return n <= self.num_free

    def alloc(self, n: int) -> torch.Tensor:
        """Return `n` distinct free ids (int64, CPU), or raise OutOfSlots allocating nothing."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n}")
        if n > self.num_free:
            raise OutOfSlots(f"{self.name}: need {n}, only {self.num_free} of {self.size} free")
        out = self._stack[self._top - n : self._top].flip(0)  # flip copies: the caller owns its ids
        self._top -= n
        self._owned[out] = True
        return out

    def free(self, ids: torch.Tensor | Iterable[int]) -> None:
        """Return ids to the pool. Raises DoubleFree (freeing nothing) unless every id is owned once."""
        ids = torch.as_tensor(ids, dtype=torch.int64).flatten().cpu()
        if ids.numel() == 0:
            return
        if int(ids.min()) < 1 or int(ids.max()) > self.size:
            raise DoubleFree(
                f"{self.name}: free of ids outside 1..{self.size}: {ids[(ids < 1) | (ids > self.size)][:8].tolist()}"
            )
        if torch.unique(ids).numel() != ids.numel():
            raise DoubleFree(f"{self.name}: the same id appears twice in one free: {_repeated(ids)[:8]}")
        not_owned = ids[~self._owned[ids]]
        if not_owned.numel():
            raise DoubleFree(f"{self.name}: double free (ids not allocated): {not_owned[:8].tolist()}")
        self._owned[ids] = False
        self._stack[self._top : self._top + ids.numel()] = ids.flip(0)
        self._top += ids.numel()

    def check_integrity(self, holders: Iterable[torch.Tensor] | None = None) -> None:
        """Assert free + used == total and no id is both free and used (or free twice).

        With `holders` (the ids each live owner holds), also assert that no id is held twice and that
        the held ids are exactly the used ones, so a leak or a shared slot is caught.
        """
        free = self._free
        if torch.unique(free).numel() != free.numel():
            raise IntegrityError(f"{self.name}: an id is on the free list twice: {_repeated(free)[:8]}")
        if free.numel() and bool(self._owned[free].any()):
            raise IntegrityError(f"{self.name}: ids both free and used: {free[self._owned[free]][:8].tolist()}")
        if bool(self._owned[0]) or bool((free == 0).any()):
            raise IntegrityError(f"{self.name}: the padding id 0 was handed out")
        used = int(self._owned.sum())
        if used + free.numel() != self.size:
            raise IntegrityError(f"{self.name}: free {free.numel()} + used {used} != total {self.size}")
        if holders is None:
            return
        held = [torch.as_tensor(h, dtype=torch.int64).flatten().cpu() for h in holders]
        held = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        if torch.unique(held).numel() != held.numel():
            raise IntegrityError(f"{self.name}: ids owned by two holders: {_repeated(held)[:8]}")
        if held.numel() != used or (held.numel() and not bool(self._owned[held].all())):
            raise IntegrityError(
                f"{self.name}: holders hold {held.numel()} ids but {used} are used (leak or stale holder)"
            )


def _repeated(ids: torch.Tensor) -> list[int]:
    values, counts = torch.unique(ids, return_counts=True)
    return values[counts > 1].tolist()
