"""Process helpers for the demo, benchmarks and tests: free loopback ports, wait for SERVING, stop."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = 600.0, say=None) -> None:
    """Until the service on `address` reports SERVING; raise if `proc` exits first or `timeout` passes.
    `say(seconds)` is called every 30 s of waiting (a first start on a busy host can take minutes: the
    model loads and the CPU linear layouts are timed)."""
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    start = time.time()
    deadline, next_say = start + timeout, start + 30
    while time.time() < deadline:
        if say is not None and time.time() >= next_say:
            say(time.time() - start)
            next_say += 30
        if proc.poll() is not None:
            raise RuntimeError(f"service on {address} exited with code {proc.returncode}")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"service on {address} not serving after {timeout:.0f}s")


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
