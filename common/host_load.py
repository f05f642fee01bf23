"""What else runs on this process's CPUs while it times something: the conditions a timing was taken under.

A layout table timed while another process used a core kept a slow choice for good (issue 41: a
batch-1 forward 47.5 ms with that table against 19.7 ms re-timed on the quiet host). So every
timing is taken inside a window of this probe, and the window says whether the host was quiet:
- `foreign_cpus`: CPU time that other processes used on the CPUs this process may run on
  (`os.sched_getaffinity`, the per-CPU lines of /proc/stat), minus this process's own
  (`time.process_time`), per second of the window: 0 on a quiet host, ~1 with one busy neighbour;
- `steal`: the share of those CPUs' time the hypervisor gave to other guests (/proc/stat's steal);
- `loadavg` and `runnable` (/proc/loadavg) and `cpus` (the affinity set) are recorded alongside.
Off Linux (no /proc) the figures read as quiet: the timing itself then decides (its repeat spread).
So does a window shorter than MIN_WINDOW_S: /proc/stat counts in clock ticks (10 ms), so one tick of
a neighbour in a 5 ms window would read as two busy cores (a tiny model's timing; its check's
verdict needs CHECK_MIN_MS anyway).
`HostProbe` is the real probe; tests pass an object with the same `sample`/`between` methods.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

FOREIGN_MAX = 0.25  # other processes used at most a quarter of a core on our CPUs: quiet
STEAL_MAX = 0.05  # and the hypervisor took at most 5% of their time
MIN_WINDOW_S = 0.2
USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Sample:
    wall: float  # time.monotonic()
    own_cpu: float  # this process's CPU seconds, all threads
    busy: float  # CPU seconds (non-idle, non-steal) on our CPUs, every process
    steal: float  # CPU seconds stolen on our CPUs
    total: float  # every CPU second on our CPUs


@dataclass(frozen=True)
class Conditions:
    """A window's host conditions; `quiet` is the verdict a timing trusts."""

    cpus: int = 0
    loadavg: float = 0.0
    runnable: int = 0
    foreign_cpus: float = 0.0
    steal: float = 0.0
    seconds: float = 0.0

    @property
    def quiet(self) -> bool:
        return self.foreign_cpus <= FOREIGN_MAX and self.steal <= STEAL_MAX

    def describe(self) -> str:
        return (
            f"other processes {self.foreign_cpus:.2f} cores, steal {100 * self.steal:.0f}%, "
            f"load average {self.loadavg:.2f}, {self.runnable} runnable, {self.cpus} CPUs over {self.seconds:.1f} s"
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d) -> Conditions:
        """From a stored table; raises ValueError on a malformed record."""
        if not isinstance(d, dict) or set(d) != set(cls.__dataclass_fields__):
            raise ValueError(f"bad conditions {d!r}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in d.values()):
            raise ValueError(f"bad conditions {d!r}")
        return cls(**d)


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class HostProbe:
    """The real probe: /proc/stat, /proc/loadavg and the process's CPU time."""

    def sample(self) -> Sample:
        cpus = _affinity()
        busy = steal = total = 0.0
        for line in _read("/proc/stat").splitlines():
            name, *fields = line.split() or [""]
            if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
                continue
            ticks = [int(x) for x in fields[:8]] + [0] * (8 - len(fields[:8]))
            user, nice, system, idle, iowait, irq, softirq, stolen = ticks
            busy += user + nice + system + irq + softirq
            steal += stolen
            total += user + nice + system + idle + iowait + irq + softirq + stolen
        return Sample(time.monotonic(), time.process_time(), busy / USER_HZ, steal / USER_HZ, total / USER_HZ)

    def between(self, a: Sample, b: Sample) -> Conditions:
        seconds = max(b.wall - a.wall, 1e-9)
        foreign = max(0.0, (b.busy - a.busy) - (b.own_cpu - a.own_cpu)) / seconds
        total = b.total - a.total
        if seconds < MIN_WINDOW_S:  # too short to tell at the clock tick's resolution: read as quiet
            foreign, total = 0.0, 0.0
        loadavg, runnable = 0.0, 0
        fields = _read("/proc/loadavg").split()
        if len(fields) >= 4:
            loadavg, runnable = float(fields[0]), int(fields[3].split("/")[0])
        return Conditions(
            cpus=len(_affinity()),
            loadavg=loadavg,
            runnable=runnable,
            foreign_cpus=round(foreign, 3),
            steal=round((b.steal - a.steal) / total, 4) if total > 0 else 0.0,
            seconds=round(seconds, 3),
        )

    def window(self, seconds: float) -> Conditions:
        """The conditions over the next `seconds` (this thread sleeps meanwhile)."""
        a = self.sample()
        time.sleep(seconds)
        return self.between(a, self.sample())
