"""How long an idle OpenMP worker spins in a service process: set before torch loads libgomp.

The prefill and decode services run as two processes that may share cores. GNU libgomp lets a
worker spin ~300k times (milliseconds) after each parallel region before it sleeps; that is what
makes the ~150 regions of one forward cheap (common/forward/intra_op.py), but across processes a
spinning worker holds a core the other service needs. So the two services spin differently:
- prefill, bursty, spins 10k times, so that its idle workers leave the cores to decode at once.
  With both services at ~300k on the 2-core dev machine at batch 64 the pair decoded at 277 tok/s,
  with both at 10k at 571 (TTFT 14.5 -> 5.7 s; BENCHMARKS.md, 2026-11-25).
- decode, which steps without a pause while it has requests, keeps ~300k: against 10k, on the same
  machine with prefill at 10k, 24.2 -> 25.8 tok/s at batch 1, 211.9 -> 246.6 at 16, 408.9 -> 416.6
  at 64 (bench.pair_ab, medians of 6 rounds). With 10k its workers slept between the regions of a
  forward whenever the Python between them outlasted the spin, and each region paid a futex wake.
A GOMP_SPINCOUNT already in the environment wins. Imports nothing heavy: call it first.
"""

from __future__ import annotations

import os

SPIN_COUNTS = {"prefill": "10000", "decode": "300000"}


def set_default(service: str) -> None:
    """The spin count of `service` ("prefill" or "decode") unless GOMP_SPINCOUNT is set."""
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNTS[service])
