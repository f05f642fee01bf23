"""gRPC server plumbing shared by both services: message limits, health, reflection.

Message limits are set on purpose (never the 4 MiB default): KV chunks are bounded by
`max_chunk_bytes` and the limit leaves headroom above it.
"""

from __future__ import annotations

import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.engine import intra_op

DEFAULT_MAX_CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES, keepalive: bool = False) -> list[tuple[str, int]]:
    """Message limits; with `keepalive` (channels to prefill replicas), HTTP/2 pings every 2 s, also
    while a call sends no data, so a half-open connection (a dead host) is noticed (the decode side's
    progress watchdog covers a peer that is alive but silent); and a short reconnect backoff (at most
    1 s), so a replica that starts or restarts after the channel was made is used within about a
    second, not after gRPC's default backoff of up to 120 s."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    if keepalive:
        options += [("grpc.keepalive_time_ms", 2_000), ("grpc.keepalive_timeout_ms", 2_000),
                    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1_000)]
    return options


SERVER_OPTIONS = [("grpc.keepalive_permit_without_calls", 1),         # accept our clients' pings
                  ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
                  ("grpc.http2.max_ping_strikes", 0)]


class Server:
    """A grpc.Server with health (NOT_SERVING until `set_serving`) and reflection for `service_names`."""

    def __init__(self, host: str, port: int, service_names: list[str], max_workers: int = 64):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc",
                                                     initializer=intra_op.pin_single),
                                  options=channel_options() + SERVER_OPTIONS)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.address = f"{host}:{self.port}"
        self.set_serving(False)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def start(self) -> "Server":
        self.server.start()
        return self

    def stop(self, grace: float = 2.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait()


def wait_for_shutdown_signal() -> None:
    """Block until SIGINT or SIGTERM (the CLIs' main thread)."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
