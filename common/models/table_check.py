"""The start-up check of a stored linear-layout table: its batch-1 choice against each single layout.

A stored table is loaded at every later start; one timed under load keeps a slow choice for good.
So before its plans are applied, each start runs every linear of the model once at one row, in
model order (what a decode step at batch 1 streams: ~all of its bytes), under the stored choice
and under each layout alone (the runner-up among them), interleaved over CHECK_ROUNDS rounds,
each layout by its pass over the stored choice's in the same round (interleaved.py: the host's memory
bandwidth moves within seconds: by the medians of whole passes a start found panels 11% faster than the
stored choice and timed the table again, ~10 s, and the next start's check had them 8% slower): ~0.5 s for
SmolLM2-135M. It runs inside a window of the host probe
(`common/host_load.py`), so its verdict counts only when the host was quiet meanwhile. A layout
beating the stored choice by more than CHECK_MARGIN (and CHECK_MIN_MS) means the table was timed
under other conditions: the caller (`linear_tuning.tune_and_log`) times it again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.host_load import Conditions
from common.models import interleaved
from common.models.packed_linear import LAYOUTS, LinearWeight

CHECK_ROUNDS = 5
CHECK_MARGIN = 0.10  # a layout at least 10% faster than the stored choice disagrees with it
CHECK_MIN_MS = 0.5  # ... and by at least this much per pass (tiny models' passes are all noise)
STORED = "stored"


def _usable(w: LinearWeight, layout: str) -> bool:
    """Whether `w` still holds the layout's copy (a plan without oneDNN or panels dropped it)."""
    return {"onednn": w.packed, "panels": w.panels}.get(layout, w.weight) is not None


def candidates(weights: list[LinearWeight], plans: dict) -> dict[str, list[str]]:
    """Per candidate, the layout of each weight at one row: the stored choice, then each layout alone
    (unless it is the stored choice already, or a weight no longer holds its oneDNN or panel copy)."""
    stored = [plans[w.shape_key][0] for w in weights]
    out = {STORED: stored}
    for name in LAYOUTS:
        if [name] * len(weights) != stored and all(_usable(w, name) for w in weights):
            out[name] = [name] * len(weights)
    return out


def time_pass(weights: list[LinearWeight], layouts: list[str], xs: dict) -> float:
    """Seconds for one row through every weight in turn, each in its layout (the real timer)."""
    start = time.perf_counter()
    for w, layout in zip(weights, layouts):
        w.run(layout, xs[w.in_features])
    return time.perf_counter() - start


@dataclass
class Verdict:
    ms: dict[str, float]  # median ms per pass of each candidate
    conditions: Conditions = field(default_factory=Conditions)
    ratio: dict[str, float] = field(default_factory=dict)  # each one's median pass over the stored choice's, by round

    @property
    def best(self) -> str:
        by = self.ratio or self.ms
        return min(by, key=by.__getitem__)

    @property
    def disagrees(self) -> bool:
        gain = 1 - self.ratio.get(self.best, 1.0)  # the best layout's share less than the stored choice's
        return gain > CHECK_MARGIN and gain * self.ms[STORED] > CHECK_MIN_MS

    def describe(self) -> str:
        cells = ", ".join(
            f"{name} {ms:.2f}" + (f" (x{self.ratio[name]:.3f})" if name != STORED and name in self.ratio else "")
            for name, ms in self.ms.items()
        )
        return f"ms per pass of the linears at 1 row (x: against the stored choice in the same round): {cells}"


def check(
    weights: list[LinearWeight],
    plans: dict,
    probe,
    timer: Callable[[list[LinearWeight], list[str], dict], float] = time_pass,
    rounds: int = CHECK_ROUNDS,
) -> Verdict:
    """Time the stored batch-1 choice against each layout alone; `probe` (host_load.HostProbe or a
    test's stand-in) gives the conditions over the check. Needs every weight's oneDNN copy: run it
    before the stored plans are applied (set_plan drops copies the plan does not use)."""
    runs = candidates(weights, plans)
    if not all(map(_usable, weights, runs[STORED])):
        return Verdict({STORED: 0.0})  # weights planned before, without the copies: nothing to compare
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        xs = {w.in_features: torch.randn(1, w.in_features) for w in weights}
        for layouts in runs.values():
            timer(weights, layouts, xs)  # first calls pay one-time set-up
        before = probe.sample()
        for r in range(rounds):
            for name in interleaved.rotated(list(runs), r):  # each candidate first in turn
                times[name].append(1e3 * timer(weights, runs[name], xs))
        conditions = probe.between(before, probe.sample())
    ms = {name: statistics.median(t) for name, t in times.items()}
    return Verdict(ms, conditions, interleaved.median_ratios(times, STORED))
