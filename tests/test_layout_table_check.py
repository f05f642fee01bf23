"""A layout table that one busy moment cannot keep (issue 41): the host probe's verdict, the table
stored provisional with its conditions, the start-up check of a stored table and the re-timing it
triggers, all driven by stand-in probes and timers so the detection is deterministic."""

import json
import logging
import math
import os
import statistics
import time

import pytest
import torch
from torch import nn

from common.host_load import MIN_WINDOW_S, USER_HZ, Conditions, HostProbe, Sample
from common.models import cpu_fused, host_table, linear_tuning, packed_linear, table_check
from common.models.packed_linear import LAYOUTS, ROW_BUCKETS, LinearWeight, linear_weights

pytestmark = pytest.mark.skipif(
    not packed_linear.available(torch.device("cpu"), torch.float32), reason="needs oneDNN on CPU"
)

QUIET = Conditions(cpus=2, loadavg=0.1, runnable=1, foreign_cpus=0.02, steal=0.0, seconds=1.0)
BUSY = Conditions(cpus=2, loadavg=1.9, runnable=3, foreign_cpus=0.97, steal=0.0, seconds=1.0)


class Host:
    """A stand-in host: the probe says what `busy` says; under load the layouts time as on the AMD
    host of issue 41 (oneDNN looks best at one row), quiet rowblock wins one row. Both the tuning's
    measure and the start-up check's timer read the same truth."""

    def __init__(self):
        self.busy = False
        self.timings = 0  # measure calls: how often the layouts were timed
        self.spread = 0.0  # the repeat spread measure reports
        self.check_busy = None  # the start-up check's timings as on a busy (True) or quiet host; None: as `busy`

    # the probe
    def sample(self):
        return None

    def between(self, a, b):
        return BUSY if self.busy else QUIET

    def window(self, seconds):
        return self.between(None, None)

    def ms(self, layout: str, rows: int, busy: bool | None = None) -> float:
        busy = self.busy if busy is None else busy
        if rows == 1:
            return {"mkl": 3.0, "onednn": 1.5, "rowblock": 1.0 if not busy else 2.4, "panels": 5.0}[layout]
        return {"mkl": 3.0, "onednn": 1.0, "rowblock": 4.0, "panels": 4.5}[layout]

    def measure(self, weights, rows):
        self.timings += 1
        seconds = linear_tuning.Seconds({name: self.ms(name, rows) for name in LAYOUTS})
        seconds.spread = self.spread
        return seconds

    def check_timer(self, weights, layouts, xs):  # seconds per pass, 1 ms per weight-unit
        return sum(self.ms(layout, 1, self.check_busy) for layout in layouts) / 1e3


def _weights():
    model = nn.Sequential(nn.Linear(8, 32, bias=False), nn.Linear(32, 8), nn.Linear(8, 32, bias=False))
    return linear_weights(packed_linear.pack_linears(model))


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setenv(host_table.ENV_DIR, str(tmp_path))
    h = Host()
    real_tune = linear_tuning.tune
    monkeypatch.setattr(linear_tuning, "tune", lambda weights, mode: real_tune(weights, mode, measure=h.measure))
    return h


def _start(h: Host, mode: str = "auto"):
    weights = _weights()
    hooks = linear_tuning.Hooks(probe=h, check_timer=h.check_timer)
    return weights, linear_tuning.tune_and_log(weights, mode, hooks=hooks)


def _record(tmp_path) -> dict:
    [stored] = list(tmp_path.iterdir())
    return json.loads(stored.read_text())


def test_a_table_timed_under_load_is_provisional_and_a_quiet_start_times_it_again(host, tmp_path, caplog):
    host.busy = True
    with caplog.at_level(logging.WARNING, logger=linear_tuning.__name__):
        weights, table = _start(host)
    assert table.provisional and table.conditions == BUSY and "provisional" in caplog.text
    assert all(w.plan[0] == "onednn" for w in weights), "under load the slow choice"
    record = _record(tmp_path)
    assert record["provisional"] and record["conditions"] == BUSY.to_json() and not record["retimed_because"]

    timings = host.timings
    weights, table = _start(host)  # still busy: kept, nothing timed, the check's verdict not used
    assert host.timings == timings and table.source and table.provisional
    assert not table.check.conditions.quiet and "verdict not used" in "\n".join(table.lines())

    host.busy = False
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=linear_tuning.__name__):
        weights, table = _start(host)  # quiet now: timed again before serving, and the log says why
    assert host.timings > timings and not table.source and not table.provisional
    assert all(w.plan[0] == "rowblock" for w in weights)
    assert "timing again" in caplog.text and "provisional" in caplog.text and "0.97 cores" in caplog.text
    record = _record(tmp_path)
    assert not record["provisional"] and "provisional" in record["retimed_because"]
    assert record["conditions"] == QUIET.to_json()
    # the quiet start's choice is the clean one: its batch-1 pass as fast as a clean retime's
    clean_weights, clean = _start(host, "retime")
    assert table.chosen_ms[0] == clean.chosen_ms[0] and [w.plan for w in weights] == [w.plan for w in clean_weights]

    timings = host.timings
    _, table = _start(host)  # a quiet start with a clean table: checked, agrees, loaded
    assert host.timings == timings and table.source and table.check.best == table_check.STORED


def test_a_stored_table_the_check_disagrees_with_is_timed_again_only_on_a_quiet_host(host, tmp_path, caplog):
    """A table stored as quiet whose batch-1 choice a quiet start's check beats (load the probe could
    not see, or a table from before the probe) is timed again; on a busy host it is kept."""
    host.busy = True
    _start(host)
    record = _record(tmp_path)
    del record["conditions"], record["provisional"], record["spread"], record["retimed_because"]  # an older table
    [stored] = list(tmp_path.iterdir())
    stored.write_text(json.dumps(record))

    timings = host.timings
    host.check_busy = False  # the check's timings disagree, but the probe says busy: not trusted
    weights, table = _start(host)
    assert host.timings == timings and table.source and not table.provisional and table.conditions is None
    assert table.check.disagrees and not table.check.conditions.quiet
    assert all(w.plan[0] == "onednn" for w in weights)

    host.busy = False
    with caplog.at_level(logging.WARNING, logger=linear_tuning.__name__):
        weights, table = _start(host)
    assert host.timings > timings and not table.source
    assert "beats its choice" in caplog.text and "rowblock" in _record(tmp_path)["retimed_because"]
    assert all(w.plan[0] == "rowblock" for w in weights)


def test_rounds_that_disagree_make_a_first_table_provisional_even_on_a_quiet_host(host, tmp_path):
    host.spread = 0.8  # each winner's median round 80% over its best
    _, table = _start(host)
    assert table.conditions == QUIET and table.spread == pytest.approx(0.8) and table.provisional
    assert _record(tmp_path)["provisional"] and "spread 80%" in "\n".join(table.lines())
    _, table = _start(host)  # the next quiet start times it again; a re-timing on a quiet host stands
    assert not table.source and not table.provisional and "spread 80%" in table.retimed_because
    timings = host.timings
    _, table = _start(host)  # so the start after loads it: no re-timing at every start
    assert table.source and host.timings == timings


def test_measure_keeps_the_best_round_and_reports_the_spread(monkeypatch):
    """Interleaved rounds, each in another order; the best round counts; the spread is the winner's
    median round over its best."""
    monkeypatch.setattr(linear_tuning, "SLOW_S", 1e9)  # every round runs
    script = {"mkl": [2.5] * 5, "onednn": [2.0, 1.0, 3.0, 2.0, 2.0], "rowblock": [9.0] * 5, "panels": [9.5] * 5}
    order, seen = [], {name: 0 for name in LAYOUTS}

    def timer(fn):  # measure's calls close over their layout's name as a default argument
        name = fn.__defaults__[0]
        order.append(name)
        seen[name] += 1
        return script[name][seen[name] - 1]

    weights = [LinearWeight(torch.randn(16, 8))]
    seconds = linear_tuning.measure(weights, rows=1, timer=timer)
    assert seconds["onednn"] == 1.0 and seconds["mkl"] == 2.5
    assert seen == {"mkl": 2, "onednn": 5, "rowblock": 1, "panels": 1}, "a clear loser is not timed again"
    assert seconds.spread == pytest.approx(1.0)  # median 2 of 2, 1, 3, 2, 2 over the best, 1
    assert order[:6] == ["mkl", "onednn", "rowblock", "panels", "onednn", "mkl"], "rounds rotate the order"


def test_conditions_round_trip_and_a_malformed_record_is_timed_again(tmp_path, monkeypatch):
    monkeypatch.setenv(host_table.ENV_DIR, str(tmp_path))
    assert Conditions.from_json(BUSY.to_json()) == BUSY and QUIET.quiet and not BUSY.quiet
    assert not Conditions(steal=0.2).quiet
    shapes, ms = [(16, 8, False)], {name: [1.0] * len(ROW_BUCKETS) for name in LAYOUTS}
    plans = {shapes[0]: ("mkl",) * len(ROW_BUCKETS)}
    bad = [
        {"conditions": {"cpus": 2}},
        {"conditions": {**BUSY.to_json(), "steal": "high"}},
        {"provisional": "yes", "conditions": BUSY.to_json()},
        {"provisional": True},  # provisional without conditions
        {"spread": None},
        {"retimed_because": 3},
    ]
    for how in bad:
        host_table.write(shapes, 1, plans, ms, [1.0] * len(ROW_BUCKETS), None, how)
        assert host_table.read(shapes, 1) is None, how
    host_table.write(shapes, 1, plans, ms, [1.0] * len(ROW_BUCKETS), None, {"conditions": BUSY.to_json()})
    assert host_table.read(shapes, 1)["conditions"] == BUSY


def test_a_provisional_table_whose_check_was_too_short_to_tell_looks_a_moment_longer(host, tmp_path):
    host.busy = True
    _start(host)
    host.busy = False
    looked = []
    host.between = lambda a, b: Conditions(cpus=2, seconds=0.01)  # a tiny model's check: too short to tell
    host.window = lambda seconds: looked.append(seconds) or BUSY
    _, table = _start(host)
    assert looked and table.source and table.provisional, "busy when looked at longer: kept"
    host.window = lambda seconds: looked.append(seconds) or QUIET
    _, table = _start(host)
    assert not table.source and not table.provisional


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the real probe reads /proc (Linux)")
def test_the_real_probe_reads_this_host():
    """The real probe's figures against what the test knows without it: the window's wall clock (read
    around the samples), CPU time this process burns in it, the CPUs it may run on, and the load average
    read on either side. None depends on the host's speed or load: the burn is counted in this
    process's CPU seconds, however long it takes on the wall clock."""
    burn_s = 0.3  # own CPU seconds in the window: 30 clock ticks, so a figure the probe drops shows
    probe, cpus = HostProbe(), len(os.sched_getaffinity(0))
    t0 = time.monotonic()
    a = probe.sample()
    own0 = time.process_time()
    while time.process_time() - own0 < burn_s or time.monotonic() - t0 < 1.5 * MIN_WINDOW_S:
        pass  # past MIN_WINDOW_S too, or the probe reads the window as too short and reports it quiet
    b = probe.sample()
    load_before = os.getloadavg()[0]
    c = probe.between(a, b)
    load_after = os.getloadavg()[0]
    t1 = time.monotonic()
    seconds = b.wall - a.wall
    assert t0 <= a.wall < b.wall <= t1, "sample.wall is not this window's monotonic clock"
    assert b.own_cpu - a.own_cpu >= burn_s, "sample.own_cpu misses this process's CPU time"
    # /proc/stat counts every process on our CPUs, this one included; per-CPU tick counts can lag a tick
    # or two, so half of what we burned is far outside their error and far from a probe reading nothing
    assert b.busy - a.busy >= 0.5 * (b.own_cpu - a.own_cpu), (a, b)
    # every CPU second of the affinity set passes as user, system, idle, ... or steal: wall x CPUs, to
    # a few ticks per CPU (the margin: a tick is 1/USER_HZ s, a few percent of this window)
    assert 0.5 * seconds * cpus <= b.total - a.total <= 1.5 * seconds * cpus + 4 * cpus / USER_HZ, (a, b, cpus)
    assert 0 <= b.steal - a.steal <= b.total - a.total
    # the conditions are those samples' differences, per second of the window
    assert c.cpus == cpus and c.seconds == round(seconds, 3) >= MIN_WINDOW_S
    foreign = max(0.0, (b.busy - a.busy) - (b.own_cpu - a.own_cpu)) / seconds
    assert c.foreign_cpus == round(foreign, 3) and 0 <= c.foreign_cpus <= (b.total - a.total) / seconds
    assert c.steal == round((b.steal - a.steal) / (b.total - a.total), 4) and 0 <= c.steal <= 1
    # /proc/loadavg, read while this process runs (so at least it is runnable); the 1-minute average
    # moves every 5 s, so it is one of the two values read around the probe's (printed to 0.01)
    assert c.runnable >= 1
    assert min(load_before, load_after) - 0.01 <= c.loadavg <= max(load_before, load_after) + 0.01
    # other processes' CPU time: the CPUs' busy time less this process's own, per second
    a, b = Sample(0.0, 1.0, 10.0, 0.0, 40.0), Sample(2.0, 2.5, 13.5, 0.4, 44.0)
    c = probe.between(a, b)
    assert c.foreign_cpus == pytest.approx(1.0) and c.steal == pytest.approx(0.1) and not c.quiet
    # a window shorter than the clock tick can resolve reads as quiet
    assert probe.between(a, Sample(0.01, 1.0, 10.01, 0.0, 40.02)).quiet


def test_the_check_runs_only_layouts_the_weights_still_hold():
    weights = _weights()
    plans = {w.shape_key: ("onednn",) * len(ROW_BUCKETS) for w in weights}
    assert set(table_check.candidates(weights, plans)) == {table_check.STORED, "mkl", "rowblock"}
    for w in weights:
        w.set_plan(("mkl",) * len(ROW_BUCKETS))  # drops the oneDNN copies
    assert set(table_check.candidates(weights, plans)) == {table_check.STORED, "mkl", "rowblock"}
    verdict = table_check.check(weights, plans, Host(), timer=lambda *a: pytest.fail("nothing to time"))
    assert not verdict.disagrees
    mkl = {w.shape_key: ("mkl",) * len(ROW_BUCKETS) for w in weights}
    assert set(table_check.candidates(weights, mkl)) == {table_check.STORED, "rowblock"}


class TimedPasses:
    """A stand-in timer for table_check.check: the real timer (table_check.time_pass) for every pass,
    recording which layouts each call ran, which weight runs the real timer's clock enclosed and what
    it returned; the calls that time the layouts `slow` also get `penalty_s` more seconds (a stand-in
    slower layout, without sleeping)."""

    def __init__(self, weights, slow: list[str] | None = None, penalty_s: float = 0.0):
        self.slow, self.penalty_s = slow, penalty_s
        self.calls: list[tuple[tuple[str, ...], float]] = []  # (layouts, seconds returned)
        self.runs: list[tuple[int, str, tuple, float]] = []  # (weight index, layout, x shape, seconds)
        for i, w in enumerate(weights):  # each weight's run timed on its own, inside the real timer's pass
            w.run = self._spy(i, w.run)

    def _spy(self, i, run):
        def timed(layout, x2, residual=None):
            start = time.perf_counter()
            out = run(layout, x2, residual)
            self.runs.append((i, layout, tuple(x2.shape), time.perf_counter() - start))
            return out

        return timed

    def __call__(self, weights, layouts, xs):
        first = len(self.runs)
        seconds = table_check.time_pass(weights, layouts, xs)
        runs = self.runs[first:]
        assert [(i, layout, shape) for i, layout, shape, _ in runs] == [
            (i, layout, (1, w.in_features)) for i, (w, layout) in enumerate(zip(weights, layouts))
        ], "the real timer's pass is not one row through every weight in its layout"
        # the runs lie inside the pass the real timer clocked: it cannot have taken less than they did
        assert seconds >= sum(r[-1] for r in runs) > 0, (seconds, runs)
        if list(layouts) == self.slow:
            seconds += self.penalty_s
        self.calls.append((tuple(layouts), seconds))
        return seconds


def _mixed_plan():
    """_weights() under a stored plan that is no single layout, each laid out in panels too (the fused
    ops' GEMM): the check has five candidates."""
    weights = _weights()  # shape keys: (32, 8), (8, 32) with bias, (32, 8) again
    for w in weights:
        w.set_panels(cpu_fused.load())
    by_key = {(32, 8, False): "onednn", (8, 32, True): "mkl"}
    plans = {key: (layout,) * len(ROW_BUCKETS) for key, layout in by_key.items()}
    runs = {table_check.STORED: ("onednn", "mkl", "onednn"), **{name: (name,) * 3 for name in LAYOUTS}}
    return weights, plans, runs


def test_the_check_times_every_candidate_with_the_real_timer():
    """Structure, not speed: every candidate (the stored choice and each layout alone) warmed once and
    then timed once per round in rotating order by the real timer, each median the verdict's figure and
    each median over rounds of its pass over the stored choice's its ratio, the best the smallest ratio;
    the times positive and finite on any host."""
    weights, plans, runs = _mixed_plan()
    timer, rounds = TimedPasses(weights), 5
    verdict = table_check.check(weights, plans, Host(), timer=timer, rounds=rounds)
    names = list(runs)  # the candidates' order: stored first, then LAYOUTS
    assert [layouts for layouts, _ in timer.calls[: len(names)]] == [runs[n] for n in names], "a warm-up per candidate"
    timed = timer.calls[len(names) :]
    expected = [runs[n] for r in range(rounds) for n in names[r % len(names) :] + names[: r % len(names)]]
    assert [layouts for layouts, _ in timed] == expected, "each candidate once per round, each first in turn"
    assert all(0 < s < math.inf for _, s in timer.calls)
    assert set(verdict.ms) == set(names) and verdict.conditions == QUIET
    ms = {name: [1e3 * s for layouts, s in timed if layouts == runs[name]] for name in names}  # one per round
    for name in names:
        assert verdict.ms[name] == pytest.approx(statistics.median(ms[name])), name
        by_round = [m / stored for m, stored in zip(ms[name], ms[table_check.STORED])]
        assert verdict.ratio[name] == pytest.approx(statistics.median(by_round)), name
    assert verdict.ratio[verdict.best] == min(verdict.ratio.values())


@pytest.mark.parametrize("slow", [table_check.STORED, "rowblock"])
def test_the_check_finds_a_stand_in_slower_layout(slow):
    """Real passes with one candidate made slower by a virtual second (never slept): a real pass of
    these three tiny linears takes microseconds, so the second decides on any host, loaded or not."""
    weights, plans, runs = _mixed_plan()
    timer = TimedPasses(weights, slow=list(runs[slow]), penalty_s=1.0)
    verdict = table_check.check(weights, plans, Host(), timer=timer)
    assert verdict.ms[slow] >= 1e3 and verdict.best != slow, verdict.describe()
    if slow == table_check.STORED:  # a stored choice slower than a layout alone: the check disagrees
        assert verdict.disagrees, verdict.describe()


def test_a_host_slowing_down_in_the_middle_round_does_not_make_the_check_disagree():
    """Every layout as fast as the stored choice, and the host 1.3x slower from the middle round on, just
    after panels ran in it and before the stored choice did (its memory bandwidth moved like this within
    seconds on a 2-core Zen 4): by the medians of whole passes panels would look 23% faster; by each
    round's ratio they are level."""
    weights, plans, runs = _mixed_plan()
    panels = []

    def timer(weights, layouts, xs):
        slow = len(panels) >= 4  # panels ran in its warm-up and rounds 0, 1 and 2: round 2 goes on slower
        panels.extend([layouts] if list(layouts) == list(runs["panels"]) else [])
        return 0.02 * (1.3 if slow else 1.0)

    verdict = table_check.check(weights, plans, Host(), timer=timer, rounds=5)
    assert verdict.ms["panels"] < verdict.ms[table_check.STORED] / 1.2  # what whole passes would have said
    assert verdict.ratio["panels"] == pytest.approx(1.0) and not verdict.disagrees, verdict.describe()
