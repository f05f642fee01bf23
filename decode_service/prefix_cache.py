"""Decode's prefix cache (`--disaggregation-decode-enable-radix-cache`, issue 57): the KV of finished
requests kept in a radix tree (common/engine/radix_cache.py, the same tree prefill uses), so the next
turn of a conversation, whose prompt is the last one's prompt + answer + the new message, needs only
the KV of its new tokens from prefill.

SlotBooks (slot_books.py) holds it and is the only caller:
  1. `take(req)` at admission: the longest cached prefix of the prompt (at most all but its last
     position: the handoff always carries one), locked so nothing evicts it while the request lives;
     the request reserves slots for the rest only, and asks prefill for the KV from `req.prefix_len`
     on (HandoffRequest.kv_start, with a digest of those ids); a replica that refuses it (the digest does
     not match: FAILED_PRECONDITION) has the request freed and admitted again without the cache, asking
     for the whole prompt (scheduler.refetch_whole); a taken prefix is locked, so never evicted meanwhile;
  2. `keep(req, valid)` at release: the request's positions whose KV is known written (its prompt and
     every output fed back: prompt + outputs - 1) join the tree; the slots the tree already had
     (another request's copy) come back to be freed, with the rest of the request's own; its lock
     is dropped;
  3. `evict(n)` when a reservation or a growth finds the pool short: unlocked leaves, least recently
     used first, before any request is refused or retracted.
n > 1: the samples share the cached prefix as they share the prompt (slot_books.SampleGroup holds the
lock and, once its last sample is freed, gives the prompt's KV to the tree: `release`). A retracted
request reserves as before, without the cache.
Every KV slot is one of: free, a live request's own, or the tree's (`all_slots`, for the integrity
check); the tree's are locked by the requests reading them.
"""

from __future__ import annotations

import torch

from common.engine.radix_cache import CacheStats, RadixCache
from decode_service.req import DecodeReq, ReqState


class DecodePrefixCache:
    def __init__(self, kv_allocator, draft: bool = False):
        """`draft`: an EAGLE / MTP head's KV shares the slots; its KV at a position was made with the
        token after it, which the tree does not key, so a match gives one position less."""
        self.tree = RadixCache(kv_allocator.free)
        self.draft = draft
        self.stats = CacheStats()  # prompt tokens admitted and how many decode held
        self.metrics = None  # DecodeMetrics (the scheduler sets it), or None

    def take(self, req: DecodeReq, limit: int | None = None) -> torch.Tensor:
        """The cached slots of `req`'s prompt prefix (locked; `req.prefix_len` of them, at most `limit`),
        possibly none."""
        slots, node, _ = self.tree.match_prefix(req.prompt_ids)
        n = min(len(slots) - self.draft, req.prompt_len - 1, req.prompt_len if limit is None else limit)
        if n <= 0:
            return slots[:0]
        self.tree.lock(node)
        req.prefix_node, req.prefix_len = node, n
        return slots[:n]

    def keep(self, req: DecodeReq) -> torch.Tensor:
        """At `req`'s release: its written positions join the tree; returns its slots to free now."""
        written = 0
        if req.state == ReqState.RUNNING:  # its KV landed: the prompt's, and each output fed back but the last
            written = min(req.prompt_len + len(req.output_ids) - 1, len(req.kv_slots))
        own = self.release(req.prompt_ids + req.output_ids, req.kv_slots, written, req.prefix_len, req.prefix_node)
        req.prefix_node, req.prefix_len = None, 0
        return own

    def release(self, tokens: list[int], slots: torch.Tensor, written: int, prefix_len: int, node) -> torch.Tensor:
        """`slots[:written]` hold the KV of `tokens[:written]`: they join the tree, and `node` (the lock
        of the `prefix_len` slots taken from it) is dropped. Returns the slots to free now: those the
        tree had already (another request's copy) and those never written; the taken prefix is the tree's."""
        present = self.tree.insert(tokens[:written], slots[:written]) if written else 0  # < present: the tree's
        own = torch.cat([slots[prefix_len : max(present, prefix_len)], slots[max(written, prefix_len) :]])
        if node is not None:
            self.tree.unlock(node)
        return own

    def untake(self, req: DecodeReq) -> None:
        """Undo `take` (the reservation around it failed)."""
        if req.prefix_node is not None:
            self.tree.unlock(req.prefix_node)
        req.prefix_node, req.prefix_len = None, 0

    def evict(self, slots: int) -> int:
        freed = self.tree.evict(slots)
        if self.metrics is not None:
            self.metrics.decode_cache_evicted_tokens.inc(freed)
        return freed

    def all_slots(self) -> list[int]:
        return self.tree.all_slots()
