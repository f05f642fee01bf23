"""Alternatives timed against each other in interleaved rounds, each by its time over the base's in the same round.

Every round runs each alternative once, back to back, the order rotated (each first in turn); an alternative
counts by the median over rounds of its time divided by the base's in that round. On a shared host whose
processes all read quiet (host_load.py), the memory bandwidth still moved between ~27 and ~42 GB/s within
seconds (a 2-core AMD Zen 4 VM: a neighbour's memory traffic, not its CPU time), and a batch-1 decode step
with it between 11 and 18 ms: a best or a median of whole times compares an alternative timed in one state
with another timed in the other, while within a round both ran in one. Used where a choice is timed at
start-up: the start-up check of the layout table (table_check.py) and decode's warm-up plan (fused_plan.py).
"""

from __future__ import annotations

import statistics


def rotated(names: list, r: int) -> list:
    """Round r's order: `names` starting from its (r mod len)-th."""
    return names[r % len(names) :] + names[: r % len(names)]


def median_ratios(times: dict, base) -> dict:
    """{name: the median over rounds of times[name][r] / times[base][r]} (times: per name one time per round
    from round 0; a name timed in fewer rounds, dropped early, counts over those)."""
    return {name: statistics.median([t / b for t, b in zip(ts, times[base])]) for name, ts in times.items()}


def rounds_faster(times: dict, base) -> dict:
    """{name: in how many of its rounds times[name][r] < times[base][r]}."""
    return {name: sum(t < b for t, b in zip(ts, times[base])) for name, ts in times.items()}
