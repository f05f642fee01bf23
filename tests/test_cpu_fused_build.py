"""The fused CPU ops' build across restarts (common/models/cpu_fused.py): a builder that dies releases
its lock, a live one is waited for with a bound, a build killed mid-way (torch's lock file left, as
SIGTERM leaves it) is cleared and built again instead of every later start waiting forever, and a
library that is not the one recorded at build time is never loaded."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from common.models import cpu_fused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = """import sys, time
from common.models.cpu_fused import build_lock
with build_lock(sys.argv[1]):
    print('held', flush=True)
    time.sleep(120)
"""


def test_a_dead_builders_lock_is_released_and_a_live_one_is_waited_for_with_a_bound(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError, match="build lock"):  # a live holder: waited for, then given up on
            with cpu_fused.build_lock(str(tmp_path), wait_s=0.5):
                pass
        holder.kill()  # dies holding it: the kernel drops the flock
        holder.wait()
        with cpu_fused.build_lock(str(tmp_path), wait_s=5):
            pass
    finally:
        holder.kill()
        holder.wait()


def _fill(folder, library: bytes = b"\x7fELF library") -> str:
    (folder / cpu_fused.BUILD_LOCK).write_text("")
    (folder / f"{cpu_fused.NAME}.so").write_bytes(library)
    (folder / "cpu_fused.o").write_bytes(b"object")
    (folder / "sub").mkdir()
    (folder / "sub" / "x").write_text("x")
    return str(folder)


def test_an_interrupted_build_is_cleared_before_torch_would_wait_on_its_lock(tmp_path, caplog):
    folder = _fill(tmp_path)
    cpu_fused._record(folder)  # even a library that matches its record: the build that made it did not finish
    (tmp_path / "lock").write_text("")  # torch's FileBaton, left by a build killed mid-way
    with caplog.at_level(logging.WARNING, logger=cpu_fused.__name__):
        cpu_fused._check_folder(folder)
    assert os.listdir(folder) == [cpu_fused.BUILD_LOCK]
    assert any("interrupted" in r.getMessage() for r in caplog.records)


def test_only_the_library_recorded_at_build_time_is_kept(tmp_path):
    folder = _fill(tmp_path)
    cpu_fused._record(folder)
    cpu_fused._check_folder(folder)
    kept = [cpu_fused.BUILD_LOCK, f"{cpu_fused.NAME}.so", f"{cpu_fused.NAME}.so.sha256", "cpu_fused.o", "sub"]
    assert sorted(os.listdir(folder)) == sorted(kept)
    (tmp_path / f"{cpu_fused.NAME}.so").write_bytes(b"\x7fELF planted")  # replaced after the build
    cpu_fused._check_folder(folder)
    assert os.listdir(folder) == [cpu_fused.BUILD_LOCK]
    _fill(tmp_path)  # a library with no record (whoever put it there): not trusted either
    cpu_fused._check_folder(folder)
    assert os.listdir(folder) == [cpu_fused.BUILD_LOCK]


def test_the_real_build_records_its_library_in_a_private_folder(ops):
    folder = cpu_fused.build_dir()
    library = os.path.join(folder, f"{cpu_fused.NAME}.so")
    with open(library + ".sha256") as f:
        assert f.read() == cpu_fused._sha256(library)
    for path in (folder, os.path.dirname(folder)):
        assert os.stat(path).st_mode & 0o777 == 0o700, path


def test_sigterm_mid_build_then_a_restart_builds(tmp_path):
    """What `docker stop` during a first start does: the build dies with torch's lock file in place; the
    next start clears it and builds (before: it waited on that file forever). ~45 s: a drill."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": ROOT}
    code = "import logging\nlogging.basicConfig(level=logging.INFO)\nfrom common.models import cpu_fused\n"
    code += "cpu_fused.build_extension()"
    build = [sys.executable, "-c", code]
    first = subprocess.Popen(build, env=env, stderr=subprocess.DEVNULL)
    root = tmp_path / "disagg-serve" / "cpu-fused"
    deadline = time.monotonic() + 60  # the import and the compile's start: seconds, even on a busy 2-core host
    while not list(root.glob("*/lock")) and time.monotonic() < deadline:  # torch's baton: the compile started
        time.sleep(0.1)
    assert list(root.glob("*/lock")), "the build never started"
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=30)
    assert list(root.glob("*/lock")), "SIGTERM left no lock: the drill tests nothing"
    second = subprocess.run(build, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "interrupted" in second.stderr and "built in" in second.stderr
    assert not list(root.glob("*/lock")) and list(root.glob(f"*/{cpu_fused.NAME}.so.sha256"))
