"""Handoff fault injection for tests and drills: hooks (hooks.py) that break or stall a share of handoffs.

`FaultInjector(FaultPlan.parse("fail=0.05,stall=0.02[,seed=1]"))`, handed to
`PrefillService(config, hooks=...)` (bench/drill_prefill.py: `--inject-faults` on a command line).
Each Prefill call draws once: with probability `fail` its stream breaks with INTERNAL after the
first token and one KV chunk; with probability `stall` it stops sending after the first KV chunk
and holds the call open (until the caller gives up or cancels), like a wedged peer. Both land after
decode has started writing the reserved slots, the hardest place for cleanup. `seed` makes the
draws reproducible. The injector is also a Delays, so a drill can slow its replica down as well.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

from prefill_service.hooks import FAIL, STALL, Delays


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


class FaultInjector(Delays):
    """Draws each call's fault from `plan`; `injected` counts them by kind. `step_s` and
    `kv_message_s`: as Delays."""

    def __init__(self, plan: FaultPlan, step_s: float = 0.0, kv_message_s: float = 0.0):
        super().__init__(step_s, kv_message_s)
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._lock = threading.Lock()
        self.injected = {FAIL: 0, STALL: 0}

    def draw_fault(self) -> str | None:
        if not self.plan.active:
            return None
        with self._lock:
            x = self._rng.random()
            fault = FAIL if x < self.plan.fail else STALL if x < self.plan.fail + self.plan.stall else None
            if fault:
                self.injected[fault] += 1
        return fault
