"""A decode batch's fp32 layouts per row bucket, timed as whole steps at warm-up (CPU, `--linear-layout auto`).

The layout table (linear_tuning.py) and the gemv's streams (cpu_fused.pick_row_streams) are timed one linear at
a time; a decode step runs the whole stack in one call (cpu_step.FusedLayers) where its layouts allow, and what
the linears alone measure can mislead the step (SmolLM2, 2-core AMD Zen 4):
- at 16 rows a mix 2% faster on the linears alone (oneDNN for some shapes: the stack unfused) ran 406 tok/s in
  process against 464 with those linears in panels and the stack fused;
- at one row, op by op, panels took 20.9 ms a pass of the linears against the gemv's 23.4, and the gemv's 1, 2
  and 4 streams came within 4%; as whole steps the gemv on one stream took 11.1 ms, on four 10% more and
  panels 22% more (when the host's memory ran slower: 5% and 7%).
- at one and two rows a greedy step finds its token inside the call only where the lm_head is the float32
  gemv: with the lm_head alone in panels a step took 16% longer at one row and 7% at two (1-9% at one row when
  the memory ran slower), and one of the day's tables had it there.
So warm-up, per decode row bucket up to the largest batch (and GEMV_ROWS), times decode steps of the table's
plan against its alternatives, and keeps the fastest alternative where it is at least MIN_GAIN faster, or
faster in every round: in the host's slower memory state the ways came closer (four streams 1.048, panels
1.071, the lm_head in panels 1.014-1.091, against 1.097, 1.218 and 1.161 in the faster one), so a warm-up timed
there saw a difference under MIN_GAIN that the other state made 10-16%; one that holds in every round is kept:
1. one and two rows: every stack linear and the lm_head in the gemv (at one row at each of ROW_STREAMS streams
   per thread), and every one in panels;
2. more rows, where the table's mix leaves the stack to the modules: the same mix with those linears in panels.
The candidates run in ROUNDS interleaved rounds, each round's sample SAMPLE_S of steps, and a candidate counts
by its time over the table's in the same round (interleaved.py: the host's memory bandwidth moves within
seconds). A candidate over PRUNE after PRUNE_AFTER rounds is timed no more.
The layouts give equal results within fp32 rounding (as every layout does), and the streams the same bits, so
only speed depends on the choice.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from common.models import interleaved
from common.models.cpu_fused import ROW_STREAMS
from common.models.packed_linear import GEMV_ROWS, ROW_BUCKETS, bucket_index

log = logging.getLogger(__name__)

ROUNDS = 7
MIN_GAIN = 0.03  # an alternative is kept only this much faster (the median ratio's noise here: ~2-3%)
PRUNE, PRUNE_AFTER = 1.15, 3  # a candidate this much slower than the table after these rounds drops out
SAMPLE_S = 0.04  # one round's sample of a candidate: whole steps, about this long
FUSED = ("rowblock", "panels")  # the fp32 layouts the fused stack runs
GREEDY_STEP_ROWS = 2  # up to these rows a greedy step's token comes inside the call (kStepRows, cpu_common.h)


@dataclass(eq=False)
class Candidate:
    name: str
    plans: dict  # {LinearWeight: its whole plan}
    streams: int | None = None  # the gemv's streams per thread at one row (None: as they are)


def fused_alternative(fused_layers, i: int) -> dict | None:
    """{LinearWeight: its plan with bucket i in panels} for each of the stack's linears whose bucket-i layout
    the fused stack does not run; None where there is none, or one has no panels copy (its plan used none)."""
    changes = {}
    for lw in fused_layers.linears:
        if lw.plan[i] in FUSED:
            continue
        if lw.panels is None:
            return None
        changes[lw] = _with(lw, i, "panels")
    return changes or None


def few_row_candidates(fused_layers, i: int) -> list[Candidate]:
    """At one or two rows (bucket i), where a greedy step finds its token inside the call when the lm_head is the
    float32 gemv (cpu_step.FusedLayers.takes_head): the table's plan (at one row with the streams start-up
    picked), then every stack linear and the lm_head in the gemv (at one row at each streams count) and in
    panels where each has its panels copy."""
    linears = [*fused_layers.linears, *([fused_layers.lm_head] if fused_layers.lm_head is not None else [])]
    streams = fused_layers.ops.row_streams(0) if i == 0 else None
    table = Candidate("the table's", {lw: lw.plan for lw in linears}, streams)
    out = [table]
    for s in ROW_STREAMS if i == 0 else (None,):
        out.append(Candidate("gemv" + (f" x{s}" if s else ""), {lw: _with(lw, i, "rowblock") for lw in linears}, s))
    if all(lw.panels is not None for lw in linears):
        out.append(Candidate("panels", {lw: _with(lw, i, "panels") for lw in linears}, streams))
    return [c for c in out if c is table or (c.plans, c.streams) != (table.plans, table.streams)]


def choose(fused_layers, time_step: Callable[[int], float], max_batch: int) -> list[str]:
    """Per decode row bucket up to `max_batch` requests (and GEMV_ROWS), the table's plan or the faster
    alternative, timed by `time_step(batch)` (seconds of one decode step of `batch` requests); the lines that
    say what was timed and kept."""
    lines = []
    for i, rows in enumerate(ROW_BUCKETS):
        batch = min(rows, max_batch)
        if batch > GEMV_ROWS or bucket_index(batch) != i:
            continue
        set_streams = fused_layers.ops.row_streams if i == 0 else None
        if rows <= GREEDY_STEP_ROWS:
            candidates = few_row_candidates(fused_layers, i)
        else:
            fused = fused_alternative(fused_layers, i)
            if fused is None:
                continue
            candidates = [Candidate("the table's", {lw: lw.plan for lw in fused}), Candidate("fused", fused)]
        if len(candidates) < 2:
            continue
        said = _race(candidates, time_step, batch, set_streams)
        lines.append(f"  {batch} row{'s' if batch > 1 else ''}: {said}")
    return lines


def _race(candidates: list[Candidate], time_step: Callable[[int], float], batch: int, set_streams) -> str:
    """Time the candidates (the first is the table's) as described above, put the kept one in place and say so.
    `set_streams`: the gemv's streams setter where a candidate names its streams."""
    first = []
    for c in candidates:  # untimed: a plan's first step builds what it holds (DecodeWeights)
        _use(c, set_streams)
        first.append(time_step(batch))
    steps = max(1, math.ceil(SAMPLE_S / max(min(first), 1e-9)))
    table, racing = candidates[0], list(candidates)
    times: dict[Candidate, list[float]] = {c: [] for c in candidates}  # seconds a step, one sample per round
    for r in range(ROUNDS):
        for c in interleaved.rotated(racing, r):
            _use(c, set_streams)
            times[c].append(sum(time_step(batch) for _ in range(steps)) / steps)
        if r + 1 == PRUNE_AFTER:
            ratio = interleaved.median_ratios(times, table)
            racing = [c for c in racing if ratio[c] <= PRUNE]
    ratio, wins = interleaved.median_ratios(times, table), interleaved.rounds_faster(times, table)
    ahead = [c for c in candidates[1:] if ratio[c] < 1 - MIN_GAIN or wins[c] == ROUNDS]
    kept = min(ahead, key=ratio.__getitem__, default=table)
    _use(kept, set_streams)
    said = ", ".join(
        f"{c.name} {1e3 * statistics.median(times[c]):.2f}"
        + ("" if c is table else f" (x{ratio[c]:.3f}{'' if c in racing else ', dropped'})")
        for c in candidates
    )
    return f"ms a decode step (the median round; x: against the table's in the same round) {said}: {kept.name} kept"


def _with(lw, i: int, layout: str) -> tuple[str, ...]:
    return tuple(layout if j == i else old for j, old in enumerate(lw.plan))


def _use(candidate: Candidate, set_streams) -> None:
    for lw, plan in candidate.plans.items():
        lw.plan = plan  # (packed_linear.layout_version moves: the stack reads its layouts afresh)
    if candidate.streams is not None:
        set_streams(candidate.streams)
