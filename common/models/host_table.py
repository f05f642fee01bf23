"""The host's linear-layout table: timed once per host and model, shared by every service there.

1. The key: the host's CPU (`common/host.py`), torch's version, the thread count and the model's
   weight shapes, with the row buckets and layouts; its hash names the file under
   `$DISAGG_LINEAR_TABLE_DIR` (default `~/.cache/disagg-serve/linear-layouts/`).
2. `host_wide_lock()`: one service at a time reads, times or writes (a POSIX file lock), so the
   second service to start loads what the first timed instead of timing under its load.
3. `read` returns the record (plans, ms per bucket, when it was timed) or None when there is none,
   it is unreadable or it names other shapes: then the caller times and `write`s (atomically).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager

import torch

from common import host
from common.models.packed_linear import LAYOUTS, ROW_BUCKETS

log = logging.getLogger(__name__)

ENV_DIR = "DISAGG_LINEAR_TABLE_DIR"


def table_dir() -> str:
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "disagg-serve", "linear-layouts")


def key(shapes, threads: int) -> dict:
    return {
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


@contextmanager
def host_wide_lock():
    """One service at a time times, reads or writes the table on this host."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), "disagg-serve-linear-tuning.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read(shapes, threads: int) -> dict | None:
    """The stored record for this key, with "path" added, or None."""
    k = key(shapes, threads)
    path = path_for(k)
    try:
        with open(path) as f:
            record = json.load(f)
        if record.get("key") != k or set(map(tuple, k["shapes"])) != {tuple(p[0]) for p in record["plans"]}:
            raise ValueError("the table names another host, torch or model")
        for _, plan in record["plans"]:
            if len(plan) != len(ROW_BUCKETS) or not set(plan) <= set(LAYOUTS):
                raise ValueError(f"bad plan {plan}")
        greedy = record.get("greedy_ms") or {}
        if greedy and not _valid_greedy(greedy):
            raise ValueError(f"bad greedy head timing {greedy}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("linear layout table %s unusable (%s): timing again", path, e)
        return None
    record["path"] = path
    return record


def _valid_greedy(greedy) -> bool:
    """{"bf16": [ms per bucket], "fp32": [ms per bucket]}, numbers only."""
    return (
        isinstance(greedy, dict)
        and sorted(greedy) == ["bf16", "fp32"]
        and all(isinstance(v, list) and len(v) == len(ROW_BUCKETS) for v in greedy.values())
        and all(isinstance(x, (int, float)) for v in greedy.values() for x in v)
    )


def write(
    shapes, threads: int, plans: dict, ms: dict, chosen_ms: list[float], greedy_ms: dict | None = None
) -> str | None:
    """Store a timed table (write to a temporary file, then rename). Returns its path, None on failure."""
    k = key(shapes, threads)
    path = path_for(k)
    record = {
        "key": k,
        "timed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "plans": [[list(shape), list(plan)] for shape, plan in plans.items()],
        "ms": ms,
        "chosen_ms": chosen_ms,
        "greedy_ms": greedy_ms or {},  # the greedy head's timing (linear_tuning.tune_greedy), if the model has one
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
