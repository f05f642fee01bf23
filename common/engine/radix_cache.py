"""RadixCache: a radix tree over token ids holding KV slots: the prefill service's prefix cache.

Each edge holds a run of token ids and the KV slots of those positions (target and draft pools
share slot indices, so one slot list covers both). Finished prefills insert their prompt; a new
prompt takes the KV of its longest cached prefix and prefills only the rest (SGLang's
RadixAttention, at token granularity).

Ownership: a slot in the tree is the tree's. A request that matched a prefix locks the path to its
last matched node (lock counts up to the root), so nothing it reads is evicted; it owns only the
slots it allocated for the rest of its prompt. On insert, positions another request inserted in
the meantime come back as duplicates for the caller to free; the rest join the tree. Eviction
frees unlocked leaves, least recently used first, through `free_slots`.

Integrity: every KV slot is exactly one of free, owned by a running request, or in the tree
(`tree_size`); `locked_size` of the tree's slots are pinned by running requests.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import torch

_clock = itertools.count()  # access order for LRU (monotonic, cheaper than wall time)


class CacheStats:
    """Prompt tokens admitted and how many came from the cache (metrics, benchmarks)."""

    def __init__(self):
        self.requests = self.prompt_tokens = self.cached_tokens = self.hits = 0

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.hits += cached_tokens > 0

    @property
    def hit_rate(self) -> float:
        """Share of admitted prompt tokens whose KV was reused."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Node:
    __slots__ = ("key", "slots", "children", "parent", "lock", "last_access", "draft_next")

    def __init__(self, key: list[int], slots: torch.Tensor, parent: Node | None, draft_next: int | None = None):
        self.key, self.slots, self.parent = key, slots, parent
        # EAGLE: the head's KV at a position is made from the token after it, so the KV at this
        # edge's last position is right only for a continuation that starts with this token
        self.draft_next = draft_next
        self.children: dict[int, Node] = {}
        self.lock = 0
        self.last_access = next(_clock)


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None]):
        self.free_slots = free_slots
        self.root = Node([], torch.empty(0, dtype=torch.int64), None)
        self.root.lock = 1  # never evicted
        self.tree_size = 0
        self.locked_size = 0
        self.evicted_tokens = 0  # since start (metrics, tests)

    @property
    def evictable_size(self) -> int:
        return self.tree_size - self.locked_size

    # ---- lookup ----------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> tuple[torch.Tensor, Node, int]:
        """(KV slots of the longest cached prefix of `tokens`, the node where it ends, how many of
        those positions also hold the right EAGLE head KV for `tokens`). A match that ends inside an
        edge splits it, so the returned node covers exactly the match."""
        node, parts, i, draft_ok = self.root, [], 0, None
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            if draft_ok is None and node is not self.root and node.draft_next != tokens[i]:
                draft_ok = i - 1  # the head's KV at node's last position followed another token
            n = _common(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(_clock)
            parts.append(child.slots)
            node, i = child, i + n
        if draft_ok is None:
            draft_ok = i if i < len(tokens) and node.draft_next == tokens[i] else max(i - 1, 0)
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return slots, node, draft_ok

    def lock(self, node: Node) -> None:
        while node is not None:
            if node.lock == 0:
                self.locked_size += len(node.key)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock -= 1
            if node.lock == 0:
                self.locked_size -= len(node.key)
            node = node.parent

    # ---- insert ----------------------------------------------------------------------------------
    def insert(self, tokens: list[int], slots: torch.Tensor, draft_next: int | None = None) -> int:
        """Add `tokens` with their KV `slots` (`draft_next`: the token the head's KV at the last
        position was made with); returns how many leading positions were already in the tree (the
        caller frees its own slots among those, the rest now belong to the tree)."""
        node, i = self.root, 0
        while i < len(tokens):
            node.last_access = next(_clock)
            child = node.children.get(tokens[i])
            if child is None:
                leaf = Node(list(tokens[i:]), slots[i:].clone(), node, draft_next)
                node.children[tokens[i]] = leaf
                self.tree_size += len(leaf.key)
                return i
            n = _common(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            node, i = child, i + n
        node.last_access = next(_clock)
        return i

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; returns the new upper node (same locks as child)."""
        upper = Node(child.key[:n], child.slots[:n], child.parent, draft_next=child.key[n])
        upper.lock, upper.last_access = child.lock, child.last_access
        upper.children[child.key[n]] = child
        child.parent.children[child.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        return upper

    # ---- eviction --------------------------------------------------------------------------------
    def evict(self, tokens: int) -> int:
        """Free at least `tokens` slots from unlocked leaves, least recently used first (fewer if
        not that many are evictable); returns how many were freed."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            self.free_slots(leaf.slots)
            freed += len(leaf.key)
            self.tree_size -= len(leaf.key)
            self.evicted_tokens += len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Free everything in the tree (only when no request holds a lock)."""
        if self.locked_size:
            raise RuntimeError(f"radix cache reset with {self.locked_size} locked tokens")
        self.evict(self.tree_size)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> list[int]:
        """Every slot in the tree (integrity checks)."""
        return [s for n in self._nodes() for s in n.slots.tolist()]


def _common(key: list[int], tokens: list[int], start: int) -> int:
    n = 0
    limit = min(len(key), len(tokens) - start)
    while n < limit and key[n] == tokens[start + n]:
        n += 1
    return n
