"""SlotBooks: which request slot and which KV slots each live decode request holds.

One object owns the decode pools' bookkeeping for the scheduler (scheduler.py), which holds it:
  1. `reserve(req, outputs)` at admission, all or nothing: a request slot and KV for the prompt (and a
     retracted request's resent outputs) + `outputs` (kv_growth.py: max_new_tokens with the full
     reservation, a growth's worth on demand) + EAGLE's draft window, `extra`, which a step may write
     past the committed length; `grow(req, upto)` before a step, on demand;
  2. `free(req)` at release, once: the KV slots and the request slot, and the row's guard cleared on
     the worker's stream (ordered after every forward that can still read it: FutureMap invariant 7);
  3. `holders(reqs)` for the integrity check: every used slot named by exactly one live holder.
n > 1 is one policy of these books: the prompt's KV slots are reserved once for the n samples (a
SampleGroup, `groups` by request id until its last sample is freed), each sample's own slots beside
them; with EAGLE each sample past the first also holds its own slot for the last prompt position.
The life of the samples themselves (fork, abort, unforked ends) is sample_group.py's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from decode_service.prefix_cache import DecodePrefixCache
from decode_service.req import DecodeReq


@dataclass
class SampleGroup:
    rid: str  # the request's (sample 0's)
    prompt_len: int
    prompt_slots: torch.Tensor  # the prompt's KV slots (sample 0's first prompt_len kv_slots)
    reserved: list[tuple[int, torch.Tensor]]  # (request slot, own KV slots) of samples 1..n-1 until they fork
    samples: list[DecodeReq] = field(default_factory=list)  # every sample made so far, sample 0 first
    holders: int = 0  # samples (reserved or live) that still hold the shared slots
    shared_len: int = 0  # leading prompt slots every sample reads (EAGLE: all but the last, each sample's own)
    prefix_len: int = 0  # leading prompt slots taken from decode's prefix cache (the tree's, not the group's)
    prefix_node: object = None  # their lock in the cache, held until the last sample is freed


class SlotBooks:
    def __init__(self, worker, extra: int, eagle: bool, prefix_cache: bool = False):
        """`worker`: its `req_to_token_pool`, `kv_allocator` and `release_row`; `extra`: the KV a step may
        write past a request's reservation (EAGLE's draft window, else 0); `prefix_cache`: keep finished
        requests' KV for later prompts that start with it (prefix_cache.py)."""
        self.worker = worker
        self.pool, self.kv = worker.req_to_token_pool, worker.kv_allocator
        self.extra = extra
        self.own_last = 1 if eagle else 0  # samples 1..n-1's own slot at the last prompt position
        self.groups: dict[str, SampleGroup] = {}
        self.cache = DecodePrefixCache(self.kv, draft=eagle) if prefix_cache else None
        # With a transfer engine that writes reserved slots itself (shm, Mooncake), a slot freed while a
        # step is in flight (overlap: the step after the one whose results freed it) goes back to the
        # pool only once that step is done: the step may still write it (a finished request rides in it:
        # its next position, EAGLE's draft window), and a transfer engine's write for the next request
        # reserved there is not ordered after stream work as decode's own writes are (invariant 7).
        self.hold_while_in_flight = False  # the scheduler sets it: its KV receiver writes late, and overlap
        self.in_flight = 0  # the step in flight while frees happen (0: none)
        self._held: list[tuple[int, torch.Tensor]] = []  # (step, slots) freed while that step was in flight

    def _free_kv(self, slots: torch.Tensor) -> None:
        if self.hold_while_in_flight and self.in_flight and len(slots):
            self._held.append((self.in_flight, slots))
        else:
            self.kv.free(slots)

    def settled(self, step: int) -> None:
        """Step `step` is done: the slots freed while it was in flight go back to the pool."""
        keep = []
        for s, slots in self._held:
            if s <= step:
                self.kv.free(slots)
            else:
                keep.append((s, slots))
        self._held = keep

    def _can_alloc(self, n: int) -> bool:
        """Whether `n` KV slots can be allocated, evicting cached prefixes nobody reads to make room."""
        if self.kv.can_alloc(n):
            return True
        if self.cache is not None:
            self.cache.evict(n - self.kv.num_free)
        return self.kv.can_alloc(n)

    @property
    def kv_in_use(self) -> int:
        """KV slots requests hold (their own, and cached prefixes they read): the pool's used slots less
        the cached prefixes nobody reads, which a reservation evicts when it needs them (the load decode
        reports; SGLang's token usage counts them free too). Read from other threads: a snapshot."""
        return self.kv.num_used - (self.cache.tree.evictable_size if self.cache is not None else 0)

    @property
    def room(self) -> int:
        """The most prompt + max_new_tokens one request can reserve: the pool less the draft window."""
        return self.kv.size - self.extra

    def reserve(self, req: DecodeReq, outputs: int, keep_free: int = 0) -> bool:
        """Reserve `req`'s request slot and KV: what its handoff lands in (the prompt, and the outputs a
        retracted request resends) and `outputs` more per sample (+ `extra`), with n > 1 everything its
        n samples need; or nothing (False), also when fewer than `keep_free` slots would be left."""
        n = req.params.n if not req.retractions else 1  # a retracted sample comes back on its own
        if n == 1:
            if self.pool.allocator.num_free == 0:
                return False
            use_cache = self.cache is not None and not req.retractions and not req.whole_prompt
            cached = self.cache.take(req) if use_cache else None
            need = req.prompt_len + len(req.output_ids) + outputs + self.extra - req.prefix_len
            if not self._can_alloc(need + keep_free):
                if cached is not None:
                    self.cache.untake(req)
                return False
            req.req_pool_idx, own = self.pool.alloc(), self.kv.alloc(need)
            req.kv_slots = torch.cat([cached, own]) if req.prefix_len else own
            if cached is not None:  # counted once, when the reservation holds
                self.cache.stats.count(req.prompt_len, req.prefix_len)
            return True
        last, own = self.own_last, outputs + self.extra
        shared = req.prompt_len - last
        if self.pool.allocator.num_free < n:
            return False
        cached = self.cache.take(req, limit=shared) if self.cache is not None and not req.whole_prompt else None
        need = req.prompt_len - req.prefix_len + n * own + (n - 1) * last
        if not self._can_alloc(need + keep_free):
            if cached is not None:
                self.cache.untake(req)
            return False
        prompt = self.kv.alloc(req.prompt_len - req.prefix_len)
        prompt = torch.cat([cached, prompt]) if req.prefix_len else prompt
        reserved = [(self.pool.alloc(), self.kv.alloc(last + own)) for _ in range(n - 1)]
        req.req_pool_idx = self.pool.alloc()
        req.kv_slots = torch.cat([prompt, self.kv.alloc(own)])
        req.group = SampleGroup(req.rid, req.prompt_len, prompt, reserved, [req], holders=n, shared_len=shared)
        req.group.prefix_len, req.group.prefix_node, req.prefix_node = req.prefix_len, req.prefix_node, None
        if cached is not None:
            self.cache.stats.count(req.prompt_len, req.prefix_len)
        self.groups[req.rid] = req.group
        return True

    def grow(self, req: DecodeReq, upto: int):
        """New KV slots appended to `req`'s so that it holds `upto` positions (its own: free() frees
        them with the rest), or None when the pool has not that many free."""
        more = upto - len(req.kv_slots)
        if more <= 0:
            return req.kv_slots[:0]
        if not self._can_alloc(more):
            return None
        new = self.kv.alloc(more)
        req.kv_slots = torch.cat([req.kv_slots, new])
        return new

    def free(self, req: DecodeReq) -> None:
        """Free `req`'s request slot and KV slots once (with a group: its own, and the prompt's with the
        group's last holder; before the fork also the reservations of samples 1..n-1)."""
        group = req.group
        own = req.kv_slots if group is None else req.kv_slots[group.shared_len :]
        if self.cache is not None and group is None:  # its written KV joins the cache (prefix_cache.py)
            own = self.cache.keep(req)
        self._free_kv(own)
        self.pool.free(req.req_pool_idx)
        self.worker.release_row(req.req_pool_idx)
        if group is None:
            return
        group.holders -= 1 + len(group.reserved)
        for idx, slots in group.reserved:  # never forked: nothing of theirs reached the device
            self._free_kv(slots)
            self.pool.free(idx)
        group.reserved = []
        req.prefix_len = 0  # the group holds the prefix's lock; a retracted sample comes back without it
        if group.holders == 0:
            shared = group.prompt_slots[: group.shared_len]
            if self.cache is not None:  # the prompt's KV joins the cache once every sample is done with it
                forked = len(group.samples) > 1  # the handoff landed: the shared slots hold the prompt's KV
                prompt_ids = group.samples[0].prompt_ids
                written = group.shared_len if forked else 0
                shared = self.cache.release(prompt_ids, shared, written, group.prefix_len, group.prefix_node)
            self._free_kv(shared)
            del self.groups[group.rid]

    def holders(self, reqs: Iterable[DecodeReq]) -> tuple[list[torch.Tensor], list[list[int]]]:
        """(KV slot holders, request slot holders) of the live requests `reqs`: each slot named once."""
        kv_holders, pool_holders, groups = [], [], {}
        for r in reqs:
            if r.kv_slots is None:
                continue
            pool_holders.append([r.req_pool_idx])
            if r.group is None:
                kv_holders.append(r.kv_slots[r.prefix_len :])  # the cached prefix is the tree's
                continue
            kv_holders.append(r.kv_slots[r.group.shared_len :])
            groups[id(r.group)] = r.group
        for g in groups.values():
            kv_holders.append(g.prompt_slots[g.prefix_len : g.shared_len])  # the cached prefix is the tree's
            kv_holders.extend(slots for _, slots in g.reserved)
            pool_holders.extend([idx] for idx, _ in g.reserved)
        if self.cache is not None:
            kv_holders.append(torch.tensor(self.cache.all_slots(), dtype=torch.int64))
        kv_holders.extend(slots for _, slots in self._held)  # freed, back once their step is done
        return kv_holders, pool_holders
