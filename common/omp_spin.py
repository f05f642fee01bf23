"""How long an idle OpenMP worker spins in a service process: set before torch loads libgomp.

The prefill and decode services run as two processes that may share cores. GNU libgomp's default
lets a worker spin ~300k times (milliseconds) after each parallel region before it sleeps; that is
what makes the ~150 regions of one forward cheap (common/engine/intra_op.py), but across processes
a spinning worker holds a core the other service needs. 10k spins cost a batch-1 decode forward
nothing measurable (13.9 vs 14.1 ms) and, with both services on the 2-core dev machine at batch 64,
doubled the pair's decode rate (277 -> 571 tok/s; TTFT 14.5 -> 5.7 s; BENCHMARKS.md, 2026-11-25).
A GOMP_SPINCOUNT already in the environment wins. Imports nothing heavy: call it first.
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"


def set_default() -> None:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
