"""A decode batch's fp32 layouts per row bucket, timed as whole steps at warm-up (CPU, `--linear-layout auto`).

The layout table (linear_tuning.py) times each linear alone and may pick, at a row bucket, a mix the fused
stack (cpu_step.FusedLayers: the whole step in one call) cannot run: oneDNN for some shapes, the panel GEMM or
the gemv for the others. The step then runs the torch modules op by op, whose per-op work the linears' timing
never sees: at 16 rows of SmolLM2 (fp32, 2-core AMD Zen 4) a mix 2% faster on the linears alone ran 406 tok/s in
process against 464 with those linears in panels and the stack fused. So warm-up, for each decode row bucket up
to the largest batch where the table's mix leaves the stack to the modules, times decode steps of the table's
plan against the same plan with those linears in panels (interleaved, ROUNDS each, the median), and keeps the
panels where they are at least MIN_GAIN faster. The layouts give equal results within fp32 rounding (as every
layout does), so only speed depends on it.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

from common.models.packed_linear import GEMV_ROWS, ROW_BUCKETS, bucket_index

log = logging.getLogger(__name__)

ROUNDS = 3
MIN_GAIN = 0.03  # the fused plan is kept only this much faster (the rounds' noise on a quiet 2-core host: ~1-2%)
FUSED = ("rowblock", "panels")  # the fp32 layouts the fused stack runs


def fused_alternative(fused_layers, i: int) -> dict | None:
    """{LinearWeight: its plan with bucket i in panels} for each of the stack's linears whose bucket-i layout
    the fused stack does not run; None where there is none, or one has no panels copy (its plan used none)."""
    changes = {}
    for lw in fused_layers.linears:
        if lw.plan[i] in FUSED:
            continue
        if lw.panels is None:
            return None
        changes[lw] = tuple("panels" if j == i else layout for j, layout in enumerate(lw.plan))
    return changes or None


def choose(fused_layers, time_step: Callable[[int], float], max_batch: int) -> list[str]:
    """Per decode row bucket up to `max_batch` requests (and GEMV_ROWS), the table's plan or the fused one,
    whichever `time_step(batch)` (seconds of one decode step of `batch` requests) times faster; the lines that
    say what was timed and kept."""
    lines = []
    for i, rows in enumerate(ROW_BUCKETS):
        batch = min(rows, max_batch)
        if batch > GEMV_ROWS or bucket_index(batch) != i:
            continue
        fused = fused_alternative(fused_layers, i)
        if fused is None:
            continue
        plans = {"table": {lw: lw.plan for lw in fused}, "fused": fused}
        seconds: dict[str, list[float]] = {"table": [], "fused": []}
        for name in ("table", "fused"):  # untimed: a plan's first step builds what it holds (DecodeWeights)
            _use(plans[name])
            time_step(batch)
        for r in range(ROUNDS):
            for name in ("table", "fused") if r % 2 == 0 else ("fused", "table"):
                _use(plans[name])
                seconds[name].append(time_step(batch))
        table, fast = (statistics.median(seconds[name]) for name in ("table", "fused"))
        keep = "fused" if fast < (1 - MIN_GAIN) * table else "table"
        _use(plans[keep])
        lines.append(
            f"  {batch} rows: the table's mix {1e3 * table:.2f} ms a decode step, with its "
            f"{len(fused)} unfused linears in panels (the stack fused) {1e3 * fast:.2f} ms: {keep} kept"
        )
    return lines


def _use(plans: dict) -> None:
    for lw, plan in plans.items():
        lw.plan = plan  # (packed_linear.layout_version moves: the stack reads its layouts afresh)
