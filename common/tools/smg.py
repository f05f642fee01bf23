"""The smg gateway launched in front of decode services, on loopback, for tests and benchmarks.

`worker` is decode's gRPC address (HOST:PORT, routed as grpc://) or a URL (http://HOST:PORT: decode's
own OpenAI API, the path compose and deploy/k8s take), or a list of them (several decode replicas;
`--policy` in `extra` picks how smg routes between them). smg comes with the dev extra.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request

from common.tools.procs import free_port


def smg_binary() -> str:
    found = shutil.which("smg") or os.path.join(os.path.dirname(sys.executable), "smg")
    if not os.path.exists(found):
        raise FileNotFoundError("smg is not installed (pip install -e '.[dev]')")
    return found


@contextlib.contextmanager
def smg_in_front_of(worker: str | list[str], log_path: str, *extra: str):
    """smg in front of `worker` (its log at `log_path`): yields its base URL once ready; stopped after."""
    port = free_port()
    urls = [w if "://" in w else f"grpc://{w}" for w in ([worker] if isinstance(worker, str) else worker)]
    args = ["launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--worker-urls", *urls, "--worker-startup-check-interval", "1",
            "--health-check-interval-secs", "5", *extra]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen([smg_binary(), *args], stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.time() + 60
            while True:
                try:
                    if '"ready"' in urllib.request.urlopen(f"{base}/readiness", timeout=2).read().decode():
                        break
                except OSError:
                    pass
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"smg did not become ready (log: {log_path})")
                time.sleep(0.3)
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=20)
