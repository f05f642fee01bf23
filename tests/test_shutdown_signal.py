"""A SIGTERM while a service loads (a restart, `docker stop`, a rollout) ends the start cleanly: the CLI
has its handlers from its first line on, so it unwinds the start, removes the shm pool files decode
made and exits 0, instead of dying by the signal with those files left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("service", ["decode", "prefill"])
def test_a_sigterm_while_loading_stops_the_service_cleanly(checkpoint, tmp_path, service):
    shm = tmp_path / "shm"
    shm.mkdir()
    args = [sys.executable, "-m", f"{service}_service", "--model-path", checkpoint("llama"), "--port", "0"]
    args += ["--disaggregation-transfer-backend", "shm", "--disaggregation-shm-dir", str(shm)]
    if service == "decode":
        args += ["--prefill-addr", "127.0.0.1:1"]
    proc = subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    # a service that hangs before its "loading" line is killed: the reading loop then ends (EOF) and the
    # test fails on its exit code; 120 s is far beyond the start of a tiny model on a busy 2-core host
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        lines = []
        for line in proc.stderr:  # logging goes to stderr
            lines.append(line)
            if f"{service} service loading" in line:
                proc.send_signal(signal.SIGTERM)
                break
        _, rest = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert "SIGTERM while loading: stopped" in out, out
    assert not os.listdir(shm), os.listdir(shm)  # decode's pool files (if made) removed
