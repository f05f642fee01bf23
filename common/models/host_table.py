"""The host's linear-layout table: timed once per host and model, shared by every service there.

1. The key: the host's CPU (`common/host.py`), torch's version, the thread count and the model's
   weight shapes, with the row buckets and layouts, and what the rowblock layout runs at few rows
   (`rowblock`: torch's bmm, or the fused ops' gemv of one build: a table timed on the other path
   chose for code the forward does not run); its hash names the file under
   `$DISAGG_LINEAR_TABLE_DIR` (default `~/.cache/disagg-serve/linear-layouts/`).
2. `host_wide_lock()`: one service at a time reads, times or writes (a POSIX file lock in the user's
   own `~/.cache/disagg-serve/`), so the second service to start loads what the first timed instead
   of timing under its load.
3. `read` returns the record (plans, ms per bucket, when it was timed) or None when there is none,
   it is unreadable, malformed (logged as a warning) or it names other shapes: then the caller times
   and `write`s (atomically). A bad file never stops start-up.
4. A record also says how it was timed (`linear_tuning.py`, item 7): the host's conditions then
   (`common/host_load.py`), the repeat spread, whether it is provisional (timed on a busy host)
   and why it replaced an earlier table. Tables written before these fields load as not provisional.
5. A folder may pin its plans instead: `fixed.json` (`read_fixed`) names one layout per row bucket
   for every weight, and the greedy head's use per bucket; `--linear-layout auto` then applies it as
   it is (no timing, no start-up check). A fleet can pin what it measured once; the tests pin one
   plan (tests/linear_layouts.json) so that no test's code path depends on the host's load. A fixed
   file that cannot be read stops start-up: a pinned plan never silently turns into a timing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from contextlib import contextmanager

import torch

from common import host
from common.host_load import Conditions
from common.models.packed_linear import LAYOUTS, ROW_BUCKETS

log = logging.getLogger(__name__)

ENV_DIR = "DISAGG_LINEAR_TABLE_DIR"


FIXED = "fixed.json"


def table_dir() -> str:
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "disagg-serve", "linear-layouts")


def key(shapes, threads: int, rowblock: str = "bmm") -> dict:
    return {
        "rowblock": rowblock,
        "host": host.describe(),
        "torch": torch.__version__,
        "threads": threads,
        "buckets": list(ROW_BUCKETS),
        "layouts": list(LAYOUTS),
        "shapes": sorted([list(s) for s in set(shapes)]),
    }


def path_for(k: dict) -> str:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(table_dir(), f"{digest}.json")


def lock_path() -> str:
    """The lock file, per user: in the user's own cache folder, never a fixed name in the shared temp folder
    (where another local user could create it first and hold it)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "disagg-serve", "linear-tuning.lock")


def _open_lock(path: str) -> int:
    """The lock file's descriptor: its folder made 0700, the file 0600, never through a symlink."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


@contextmanager
def host_wide_lock():
    """One service of this user at a time times, reads or writes the table on this host. Without a usable
    lock file (a read-only home) the services go on unlocked: the lock only keeps their timings apart."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    path, fd = lock_path(), None
    try:
        fd = _open_lock(path)
    except OSError as e:
        log.warning("linear layout lock %s unusable (%s): timing without it", path, e)
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def read(shapes, threads: int, rowblock: str = "bmm") -> dict | None:
    """The stored record for this key, with "path" added, or None."""
    k = key(shapes, threads, rowblock)
    path = path_for(k)
    try:
        record = _load_json(path)
        if not isinstance(record, dict) or not isinstance(record.get("plans"), list):
            raise ValueError("not a table (a JSON object with plans)")
        if record.get("key") != k or set(map(tuple, k["shapes"])) != {tuple(p[0]) for p in record["plans"]}:
            raise ValueError("the table names another host, torch or model")
        for _, plan in record["plans"]:
            if len(plan) != len(ROW_BUCKETS) or not set(plan) <= set(LAYOUTS):
                raise ValueError(f"bad plan {plan}")
        if not _valid_timings(record.get("ms"), LAYOUTS) or not _numbers(record.get("chosen_ms")):
            raise ValueError("bad layout timings (ms, chosen_ms)")
        if not isinstance(record.get("timed_at"), str):
            raise ValueError("no timed_at")
        greedy = record.get("greedy_ms") or {}
        if greedy and not _valid_greedy(greedy):
            raise ValueError(f"bad greedy head timing {greedy}")
        _how_timed(record)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
        log.warning("linear layout table %s unusable (%s): timing again", path, e)
        return None
    record["path"] = path
    return record


MAX_TABLE_BYTES = 1 << 20  # a real table is a few KiB; past this a file is not one


def _load_json(path: str):
    """A table file's JSON; ValueError past MAX_TABLE_BYTES (read before parsing: no file's size or
    nesting can take start-up down; a nesting too deep for the parser is a RecursionError the callers catch)."""
    with open(path, "rb") as f:
        data = f.read(MAX_TABLE_BYTES + 1)
    if len(data) > MAX_TABLE_BYTES:
        raise ValueError(f"larger than {MAX_TABLE_BYTES} bytes")
    return json.loads(data)


def read_fixed() -> dict | None:
    """The folder's pinned plans, {"plan": [a layout per row bucket], "greedy": [a bool per row bucket],
    "path": the file}, or None when it has none; ValueError (naming the file) when it is malformed."""
    path = os.path.join(table_dir(), FIXED)
    try:
        record = _load_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"pinned linear layouts {path} unreadable: {e}") from e
    plan, greedy = record.get("plan") if isinstance(record, dict) else None, (record or {}).get("greedy")
    if not isinstance(plan, list) or len(plan) != len(ROW_BUCKETS) or not set(plan) <= set(LAYOUTS):
        raise ValueError(
            f"pinned linear layouts {path}: 'plan' must name one of {LAYOUTS} per row bucket {ROW_BUCKETS}"
        )
    if not isinstance(greedy, list) or len(greedy) != len(ROW_BUCKETS) or not all(isinstance(g, bool) for g in greedy):
        raise ValueError(f"pinned linear layouts {path}: 'greedy' must be true or false per row bucket {ROW_BUCKETS}")
    return {"plan": tuple(plan), "greedy": tuple(greedy), "path": path}


def _how_timed(record: dict) -> None:
    """Validate the conditions fields in place (conditions -> a Conditions); absent in older tables."""
    conditions = record.get("conditions")
    record["conditions"] = None if conditions is None else Conditions.from_json(conditions)
    if not isinstance(record.setdefault("provisional", False), bool):
        raise ValueError("bad provisional flag")
    if record["provisional"] and record["conditions"] is None:
        raise ValueError("a provisional table without its conditions")
    spread = record.setdefault("spread", 0.0)
    if not isinstance(spread, (int, float)) or isinstance(spread, bool):
        raise ValueError("bad spread")
    if not isinstance(record.setdefault("retimed_because", ""), str):
        raise ValueError("bad retimed_because")


def _numbers(values) -> bool:
    """A list of one number per row bucket."""
    return (
        isinstance(values, list)
        and len(values) == len(ROW_BUCKETS)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values)
    )


def _valid_timings(table, names) -> bool:
    """{name: [ms per bucket]} for exactly `names`."""
    return isinstance(table, dict) and sorted(table) == sorted(names) and all(map(_numbers, table.values()))


def _valid_greedy(greedy) -> bool:
    """{"bf16": [ms per bucket], "fp32": [ms per bucket]}, numbers only."""
    return _valid_timings(greedy, ["bf16", "fp32"])


def write(
    shapes,
    threads: int,
    plans: dict,
    ms: dict,
    chosen_ms: list[float],
    greedy_ms: dict | None = None,
    how_timed: dict | None = None,
    rowblock: str = "bmm",
) -> str | None:
    """Store a timed table (write to a temporary file, then rename). Returns its path, None on failure.
    `how_timed`: conditions (as JSON), spread, provisional, retimed_because (see `read`)."""
    k = key(shapes, threads, rowblock)
    path = path_for(k)
    record = {
        "key": k,
        "timed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "plans": [[list(shape), list(plan)] for shape, plan in plans.items()],
        "ms": ms,
        "chosen_ms": chosen_ms,
        "greedy_ms": greedy_ms or {},  # the greedy head's timing (linear_tuning.tune_greedy), if the model has one
        **(how_timed or {}),
    }
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the table still applies to this process
        log.warning("could not store the linear layout table at %s: %s", path, e)
        return None
    return path
