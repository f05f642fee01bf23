"""PrefixRouter: which prefill replica a prompt goes to, following the replicas' prefix caches.

Decode keeps, per replica, an approximate radix tree of the prompts it sent there (no KV, token ids
only; trimmed least-recently-used to the replica's KV pool size, as its own cache is), the way
SGLang's cache-aware router does for its workers. For each prompt, among the serving replicas:
1. balance first: when the loads (the replica's running + waiting calls, plus ours in flight) are
   far apart (max - min > BALANCE_ABS and max > BALANCE_REL * min), the least loaded one;
2. else the replica whose tree holds the longest prefix of the prompt, if it covers at least
   CACHE_THRESHOLD of it (ties: the less loaded);
3. else the least loaded (ties: the smaller tree, which has more room).
The prompt is then recorded in the chosen replica's tree. `least_loaded` policy: the least loaded,
ties taken in turn (the baseline the cache-aware choice is measured against).
Not thread-safe: the caller holds its lock.
"""

from __future__ import annotations

import torch

from common.engine.radix_cache import RadixCache

POLICIES = ("cache_aware", "least_loaded")
CACHE_THRESHOLD = 0.5  # SGLang router's default cache threshold
BALANCE_ABS = 4  # calls: below this spread the cache decides
BALANCE_REL = 1.5
DEFAULT_TREE_TOKENS = 8192  # until a replica's GetLoad says how large its pool is


class PrefixRouter:
    def __init__(self, policy: str = "cache_aware"):
        if policy not in POLICIES:
            raise ValueError(f"prefill policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.trees: dict[str, RadixCache] = {}
        self.capacity: dict[str, int] = {}
        self.routed_tokens = self.matched_tokens = 0  # prompt tokens routed, and of those found in the tree
        self._turn = 0  # least_loaded: rotates among tied replicas

    def set_capacity(self, address: str, tokens: int) -> None:
        if tokens > 0:
            self.capacity[address] = tokens

    def _tree(self, address: str) -> RadixCache:
        return self.trees.setdefault(address, RadixCache(lambda slots: None))

    def choose(self, loads: dict[str, int], prompt: list[int]) -> str:
        """The replica for `prompt` among `loads` (address -> load); records the prompt there."""
        matched = {a: self._tree(a).match_prefix(prompt)[0].numel() for a in loads}
        if self.policy == "least_loaded":
            tied = sorted(a for a in loads if loads[a] == min(loads.values()))
            self._turn += 1
            choice = tied[self._turn % len(tied)]
        else:
            choice = min(loads, key=lambda a: (loads[a], self._tree(a).tree_size))
            low, high = min(loads.values()), max(loads.values())
            balanced = not (high - low > BALANCE_ABS and high > BALANCE_REL * low)
            best = max(loads, key=lambda a: (matched[a], -loads[a]))
            if balanced and matched[best] >= CACHE_THRESHOLD * len(prompt):
                choice = best
        self.routed_tokens += len(prompt)
        self.matched_tokens += matched[choice]
        tree = self._tree(choice)
        tree.insert(prompt, torch.zeros(len(prompt), dtype=torch.int64))
        over = tree.tree_size - self.capacity.get(choice, DEFAULT_TREE_TOKENS)
        if over > 0:
            tree.evict(over)
        return choice

    @property
    def hit_rate(self) -> float:
        """Share of routed prompt tokens the chosen replica's tree already held."""
        return self.matched_tokens / self.routed_tokens if self.routed_tokens else 0.0
