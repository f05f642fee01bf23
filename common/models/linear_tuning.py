"""Choose each linear's CPU layout by measurement at start-up (`--linear-layout auto`).

1. Group the model's LinearWeights by shape (out, in, bias): weights of one shape time alike.
2. For every group and row bucket, time each layout on random input rows through all the group's
   weights in turn (so each comes from memory, as in a forward), interleaved in rounds (best of the
   rounds), on the thread count the service computes with.
3. Each weight gets, per bucket, the fastest layout of its group; the oneDNN copy is dropped where
   no bucket uses it.
4. The table (milliseconds per bucket for the whole model, each layout alone and the chosen mix) is
   logged with the host's CPU, and kept on the runner for benchmarks.
5. The host shares one table (`host_table.py`): services take turns (a file lock) and the first to
   time a model on this CPU, torch and thread count writes the table; the others, and later starts,
   load it. Two services timing at once measured each other's load: in the pair at batch 1 the mix
   they picked ran 13-16 tok/s against 17-20 with the best layout. `retime` times again and rewrites.
A forced layout (`mkl`, `onednn`, `rowblock`) skips the timing. Only speed depends on the choice:
every layout equals F.linear within fp32 rounding (tests/test_packed_linear.py).
6. The greedy head (`common/models/greedy_head.py`), where the model has one, is timed per row bucket
   against the fp32 lm_head plus argmax, after the layouts are set, and stored in the same table;
   `--greedy-head on|off` forces it. With a forced layout it is timed alone, under the same lock.
7. One noisy moment cannot keep a slow table (issue 41: timed while another process used a core, a
   batch-1 forward ran 47.5 ms against 19.7 re-timed). Each layout is timed in at least MIN_ROUNDS
   interleaved rounds (the order rotated), the best round kept and the winners' repeat spread
   (median over best) recorded; the whole timing runs inside a window of the host probe
   (`common/host_load.py`: other processes' CPU time on our CPUs, stolen time). A table timed on a
   busy host, or (a first timing) with a spread over SPREAD_MAX, is stored *provisional* with its
   conditions. At each later start the stored batch-1 choice is checked against each layout alone
   (`table_check.py`); on a quiet host a provisional table, or one the check disagrees with, is
   timed again before the service serves, and the log and the new table say why. On a busy host
   the stored table is kept and the next quiet start decides.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common import host
from common.host_load import MIN_WINDOW_S, Conditions, HostProbe
from common.models import cpu_fused, host_table, interleaved, table_check
from common.models.greedy_head import GreedyHead
from common.models.packed_linear import LAYOUTS, ROW_BUCKETS, LinearWeight

log = logging.getLogger(__name__)

CHOICES = ("auto", "retime") + LAYOUTS
GREEDY_CHOICES = ("auto", "on", "off")
ROUNDS = 5  # timed rounds per (shape, bucket); after MIN_ROUNDS, a round whose calls took over SLOW_S ends it
MIN_ROUNDS = 3
SLOW_S = 0.02
SPREAD_MAX = 0.5  # winners' median round this much over their best: disturbed (quiet Xeon: 14-18%; busy: 181%+)
CONTENDER = 1.3  # after the first round, only layouts within this factor of the fastest are timed again


@dataclass
class LayoutTable:
    """What tuning measured and chose: ms[layout][bucket index] for all the model's linears at once."""

    mode: str
    threads: int
    ms: dict[str, list[float]] = field(default_factory=dict)
    chosen_ms: list[float] = field(default_factory=list)
    plans: dict[tuple[int, int, bool], tuple[str, ...]] = field(default_factory=dict)
    source: str = ""  # the host table file it was loaded from ("" when timed here)
    greedy_ms: dict[str, list[float]] = field(default_factory=dict)  # "fp32" / "bf16" -> ms per bucket
    spread: float = 0.0  # the chosen layouts' repeat spread: (median - best) / best, worst bucket
    conditions: Conditions | None = None  # the host while it was timed (host_load.py)
    provisional: bool = False  # timed on a busy host: the next quiet start times it again
    retimed_because: str = ""  # why a stored table was timed again ("" for a first timing)
    check: table_check.Verdict | None = None  # the start-up check of a loaded table
    pinned_greedy: tuple[bool, ...] | None = None  # a pinned table's greedy head use (host_table.read_fixed)

    @property
    def greedy_plan(self) -> tuple[bool, ...]:
        """Per row bucket: the greedy head beat the fp32 lm_head (all False when it was not timed), or
        as a pinned table says."""
        if self.pinned_greedy is not None:
            return self.pinned_greedy
        if not self.greedy_ms:
            return (False,) * len(ROW_BUCKETS)
        return tuple(b < f for b, f in zip(self.greedy_ms["bf16"], self.greedy_ms["fp32"]))

    def lines(self) -> list[str]:
        out = [f"linear layout {self.mode} (forced) on {host.describe()}"]
        if self.pinned_greedy is not None:
            plan = next(iter(self.plans.values()), ())
            rows = ", ".join(f"{r}: {layout}" for r, layout in zip(ROW_BUCKETS, plan))
            return [f"linear layouts pinned by {self.source} (not timed): {rows}"]
        if self.ms:
            how = f"loaded from {self.source}" if self.source else "timed now"
            out = [f"linear layouts on {host.describe()}, {self.threads} threads ({how}), ms per step for all linears:"]
            out.append("  rows " + "".join(f"{name:>10}" for name in (*LAYOUTS, "chosen")))
            for i, rows in enumerate(ROW_BUCKETS):
                cells = [self.ms[name][i] for name in LAYOUTS] + [self.chosen_ms[i]]
                out.append(f"  {rows:>4} " + "".join(f"{c:>10.2f}" for c in cells))
            if self.conditions is not None:
                state = "PROVISIONAL (busy host)" if self.provisional else "quiet host"
                out.append(
                    f"  timed on a {state}: {self.conditions.describe()}; repeat spread {100 * self.spread:.0f}%"
                )
            if self.check is not None:
                how = "quiet" if self.check.conditions.quiet else "busy, verdict not used"
                out.append(f"  start-up check ({how}: {self.check.conditions.describe()}): {self.check.describe()}")
        if self.greedy_ms:
            out.append("  greedy token, ms: rows, fp32 lm_head + argmax, bf16 greedy head (used where faster)")
            for i, rows in enumerate(ROW_BUCKETS):
                out.append(f"  {rows:>4} {self.greedy_ms['fp32'][i]:>10.2f}{self.greedy_ms['bf16'][i]:>10.2f}")
        return out


def time_call(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Seconds(dict):
    """Seconds per weight of each layout (best round), with the winner's repeat spread."""

    spread: float = 0.0


def measure(weights: list[LinearWeight], rows: int, timer: Callable[[Callable[[], object]], float] = time_call) -> dict:
    """Seconds per weight of each layout on `rows` rows, run through all `weights` (one shape) in turn:
    as in a forward, each weight comes from memory, not from the cache the previous call warmed (one
    576x576 weight timed alone stays in cache and misleads: it picked layouts 25% slower in the model).
    Rounds interleave the layouts, each round in another order; the best round counts, and the
    winner's spread (median round over best) tells the caller whether the rounds agreed."""
    x = torch.randn(rows, weights[0].in_features)
    for name in LAYOUTS:
        weights[0].run(name, x)  # first calls pay one-time set-up (oneDNN primitives, allocator)
    calls = {name: (lambda name=name: [w.run(name, x) for w in weights]) for name in LAYOUTS}
    rounds: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for r in range(ROUNDS):
        best = {name: min(t, default=float("inf")) for name, t in rounds.items()}
        leader = min(best.values())
        for name in interleaved.rotated(list(LAYOUTS), r):
            if best[name] <= CONTENDER * leader:  # a clear loser is not timed again
                rounds[name].append(timer(calls[name]) / len(weights))
        if r + 1 >= MIN_ROUNDS and sum(min(t) for t in rounds.values()) * len(weights) > SLOW_S * len(LAYOUTS):
            break  # large shapes: enough rounds for a steady measurement
    out = Seconds({name: min(t) for name, t in rounds.items()})
    winner = rounds[min(LAYOUTS, key=out.__getitem__)]
    out.spread = statistics.median(winner) / min(winner) - 1
    return out


def tune(weights: list[LinearWeight], mode: str = "auto", measure=measure) -> LayoutTable:
    """Set every weight's plan (measured for `auto`, else the forced layout) and return the table.
    `measure(weights, rows)` -> seconds per weight and layout (a test passes made-up timings)."""
    if mode not in CHOICES:
        raise ValueError(f"--linear-layout must be one of {CHOICES}, got {mode!r}")
    table = LayoutTable(mode, torch.get_num_threads())
    if mode not in ("auto", "retime"):
        for w in weights:
            w.set_plan((mode,) * len(ROW_BUCKETS))
        return table
    groups: dict[tuple[int, int, bool], list[LinearWeight]] = {}
    for w in weights:
        groups.setdefault(w.shape_key, []).append(w)
    table.ms = {name: [0.0] * len(ROW_BUCKETS) for name in LAYOUTS}
    table.chosen_ms = [0.0] * len(ROW_BUCKETS)
    over = [0.0] * len(ROW_BUCKETS)  # ms the winners' median rounds took over their best, per bucket
    with torch.inference_mode():
        for key, members in groups.items():
            plan = []
            for i, rows in enumerate(ROW_BUCKETS):
                seconds = measure(members, rows)
                winner = min(LAYOUTS, key=seconds.__getitem__)
                plan.append(winner)
                for name in LAYOUTS:
                    table.ms[name][i] += 1e3 * seconds[name] * len(members)
                table.chosen_ms[i] += 1e3 * seconds[winner] * len(members)
                over[i] += 1e3 * seconds[winner] * len(members) * getattr(seconds, "spread", 0.0)
            table.plans[key] = tuple(plan)
            for w in members:
                w.set_plan(table.plans[key])
    table.spread = max((o / c for o, c in zip(over, table.chosen_ms) if c > 0), default=0.0)
    return table


def measure_greedy(head: GreedyHead, rows: int, timer=time_call) -> dict[str, float]:
    """Seconds for the greedy tokens of `rows` random rows: fp32 lm_head + argmax, and the greedy
    head's candidates and pick (the bound's fallback, rare on real hidden states, is not timed)."""
    x = torch.randn(rows, head.lm_head.in_features)
    calls = {"fp32": lambda: head.lm_head(x).argmax(dim=-1), "bf16": lambda: head.pick(x, head.candidates(x)[0])}
    best = dict.fromkeys(calls, float("inf"))
    for fn in calls.values():
        fn()  # one-time set-up
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            best[name] = min(best[name], timer(fn))
    return best


def tune_greedy(head: GreedyHead, measure=measure_greedy) -> dict[str, list[float]]:
    """ms per row bucket of each way to the greedy token (LayoutTable.greedy_ms)."""
    ms = {"fp32": [], "bf16": []}
    with torch.inference_mode():
        for rows in ROW_BUCKETS:
            for name, seconds in measure(head, rows).items():
                ms[name].append(1e3 * seconds)
    return ms


@dataclass
class Hooks:
    """What timing reads from the host: the load probe and the start-up check's timer (tests pass
    stand-ins, so the detection of a busy host runs deterministically)."""

    probe: object = field(default_factory=HostProbe)
    check_timer: Callable = table_check.time_pass


def tune_and_log(
    weights: list[LinearWeight],
    mode: str,
    greedy: GreedyHead | None = None,
    greedy_mode: str = "auto",
    hooks: Hooks | None = None,
) -> LayoutTable:
    """Set every weight's plan (forced, loaded from the host's table, or timed now and shared), and
    the greedy head's (forced by `greedy_mode`, else measured with the layouts)."""
    if greedy_mode not in GREEDY_CHOICES:
        raise ValueError(f"--greedy-head must be one of {GREEDY_CHOICES}, got {greedy_mode!r}")
    hooks = hooks or Hooks()
    start = time.perf_counter()
    pinned = host_table.read_fixed() if mode == "auto" else None
    if pinned is not None:
        table = LayoutTable("auto", torch.get_num_threads(), source=pinned["path"], pinned_greedy=pinned["greedy"])
        table.plans = {w.shape_key: pinned["plan"] for w in weights}
        for w in weights:
            w.set_plan(pinned["plan"])
    elif mode in ("auto", "retime"):
        with host_table.host_wide_lock():
            table, why = _load_host_table(weights, greedy, hooks) if mode == "auto" else (None, "")
            if table is None:
                table = _time_and_store(weights, mode, greedy, hooks.probe, why)
    else:
        table = tune(weights, mode)
        if greedy is not None and greedy_mode == "auto":
            with host_table.host_wide_lock():
                table.greedy_ms = tune_greedy(greedy)
    if greedy is not None:
        forced = {"on": (True,) * len(ROW_BUCKETS), "off": (False,) * len(ROW_BUCKETS)}
        greedy.set_plan(forced.get(greedy_mode, table.greedy_plan))
    for line in table.lines():
        log.info("%s", line)
    if table.ms and not table.source:
        log.info("linear layouts: %d weights in %d shapes timed in %.1f s", len(weights), len(table.plans),
                 time.perf_counter() - start)  # fmt: skip
    if table.provisional:
        log.warning(
            "linear layouts timed on a busy host (%s; repeat spread %.0f%%): stored as provisional, "
            "timed again at the next start on a quiet host (or `--linear-layout retime`)",
            table.conditions.describe() if table.conditions else "no conditions",
            100 * table.spread,
        )
    return table


def _time_and_store(weights, mode: str, greedy: GreedyHead | None, probe, why: str) -> LayoutTable:
    """Time the layouts (and the greedy head) inside a window of the host probe; store the table with
    the conditions it was timed under, provisional when the host was busy or the rounds disagreed."""
    before = probe.sample()
    table = tune(weights, mode)
    if greedy is not None:
        table.greedy_ms = tune_greedy(greedy)
    table.conditions = probe.between(before, probe.sample())
    # a re-timing on a quiet host stands even with a wide spread: no re-timing at every start
    table.provisional = not table.conditions.quiet or (table.spread > SPREAD_MAX and not why)
    table.retimed_because = why
    extra = {
        "conditions": table.conditions.to_json(),
        "spread": table.spread,
        "provisional": table.provisional,
        "retimed_because": why,
    }
    shapes = [w.shape_key for w in weights]
    kernel = rowblock_kernel(weights)
    host_table.write(shapes, table.threads, table.plans, table.ms, table.chosen_ms, table.greedy_ms, extra, kernel)
    return table


def rowblock_kernel(weights: list[LinearWeight]) -> str:
    """What the rowblock layout runs at few rows, as the host table keys it: the fused ops' gemv (of
    this build: cpu_fused.build_key) where they are attached, else torch's bmm. Tuning times the
    weights as the forward calls them, so a table timed on one path says nothing of the other."""
    if any(w.gemv is not None for w in weights):
        return f"gemv {cpu_fused.build_key()}"
    return "bmm"


def _load_host_table(weights, greedy: GreedyHead | None, hooks: Hooks) -> tuple[LayoutTable | None, str]:
    """The stored table, checked (table_check.py) and applied; or None and why it is timed again."""
    record = host_table.read([w.shape_key for w in weights], torch.get_num_threads(), rowblock_kernel(weights))
    if record is None:
        return None, ""
    if greedy is not None and not record.get("greedy_ms"):
        return None, "the stored table has no greedy head timing"  # (a table timed without the greedy head)
    plans = {tuple(shape): tuple(plan) for shape, plan in record["plans"]}
    verdict = table_check.check(weights, plans, hooks.probe, hooks.check_timer)
    timed = f"the table timed {record['timed_at']}"
    if record.get("provisional") and verdict.conditions.seconds < MIN_WINDOW_S:
        verdict.conditions = hooks.probe.window(MIN_WINDOW_S)  # a check too short to tell: look a moment longer
    if verdict.conditions.quiet and record.get("provisional"):
        how = f"{record['conditions'].describe()}; repeat spread {100 * record['spread']:.0f}%"
        why = f"{timed} is provisional (timed on a busy host or with disagreeing rounds: {how}); the host is quiet now"
        return _retiming(why, verdict)
    if verdict.conditions.quiet and verdict.disagrees:
        return _retiming(f"{timed}: at 1 row {verdict.best} beats its choice ({verdict.describe()})", verdict)
    table = LayoutTable("auto", torch.get_num_threads(), record["ms"], record["chosen_ms"])
    table.greedy_ms = record.get("greedy_ms") or {}
    table.plans = plans
    table.source = f"{record['path']}, timed {record['timed_at']}"
    table.conditions, table.provisional = record.get("conditions"), bool(record.get("provisional"))
    table.spread, table.check = record.get("spread", 0.0), verdict
    for w in weights:
        w.set_plan(table.plans[w.shape_key])
    return table, ""


def _retiming(why: str, verdict: table_check.Verdict) -> tuple[None, str]:
    log.warning("linear layouts: timing again: %s (start-up check: %s)", why, verdict.conditions.describe())
    return None, why
