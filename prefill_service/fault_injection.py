"""Handoff fault injection for tests and drills (off by default): `--inject-faults fail=0.05,stall=0.02`.

Each Prefill call draws once: with probability `fail` its stream breaks with INTERNAL after the
first token and one KV chunk; with probability `stall` it stops sending after the first KV chunk
and holds the call open (until the caller gives up or cancels), like a wedged peer. Both land after
decode has started writing the reserved slots, the hardest place for cleanup. `seed` makes the
draws reproducible.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

STALL_MAX_S = 600.0  # a stalled call ends by itself after this long at the latest


@dataclass(frozen=True)
class FaultPlan:
    fail: float = 0.0
    stall: float = 0.0
    seed: int | None = None

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan:
        """ "fail=0.05,stall=0.02[,seed=1]" -> FaultPlan; ValueError naming a bad key or value."""
        if not spec:
            return cls()
        values: dict = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in ("fail", "stall", "seed"):
                raise ValueError(f"--inject-faults: unknown key {key!r} (fail, stall, seed)")
            values[key] = int(value) if key == "seed" else float(value)
            if key != "seed" and not 0 <= values[key] <= 1:
                raise ValueError(f"--inject-faults: {key} must be a probability in [0, 1], got {value}")
        if values.get("fail", 0) + values.get("stall", 0) > 1:
            raise ValueError("--inject-faults: fail + stall must be <= 1")
        return cls(**values)

    @property
    def active(self) -> bool:
        return self.fail > 0 or self.stall > 0


class FaultInjector:
    def __init__(self, plan: FaultPlan):
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._lock = threading.Lock()
        self.injected = {"fail": 0, "stall": 0}

    def draw(self) -> str | None:
        """None (a healthy call), "fail" or "stall"."""
        if not self.plan.active:
            return None
        with self._lock:
            x = self._rng.random()
            fault = "fail" if x < self.plan.fail else "stall" if x < self.plan.fail + self.plan.stall else None
            if fault:
                self.injected[fault] += 1
        return fault
