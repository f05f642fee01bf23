"""gRPC plumbing shared by both services: message limits, keepalive options, the shutdown signal.

Message limits are set on purpose (never the 4 MiB default): KV chunks are bounded by
`max_chunk_bytes` and the limit leaves headroom above it. A Prefill caller may ask for its own bound
only within [MIN_REQUEST_CHUNK_BYTES, MAX_CHUNK_BYTES] (common/wire/kv_chunks.py `chunk_bound`): a
tiny one would make one chunk per token and layer, a huge one messages over the receive limit.
"""

from __future__ import annotations

import signal
import threading

DEFAULT_MAX_CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20
MIN_REQUEST_CHUNK_BYTES = 256 << 10  # the least a Prefill request may ask for (the operator's flag may go lower)
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES // 2  # the most anyone may set: a chunk's message stays under the limit


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES, keepalive: bool = False) -> list[tuple[str, int]]:
    """Message limits; with `keepalive` (channels to prefill replicas), HTTP/2 pings every 2 s, also
    while a call sends no data, so a half-open connection (a dead host) is noticed (the decode side's
    progress watchdog covers a peer that is alive but silent); and a short reconnect backoff (at most
    1 s), so a replica that starts or restarts after the channel was made is used within about a
    second, not after gRPC's default backoff of up to 120 s."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if keepalive:
        options += [
            ("grpc.keepalive_time_ms", 2_000),
            ("grpc.keepalive_timeout_ms", 2_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1_000),
        ]
    return options


SERVER_OPTIONS = [
    # the servers ping their clients too: a call from a host that vanished (no FIN, no RST) ends
    # within ~15 s, freeing its handler and what it holds, instead of when TCP gives up (minutes)
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),  # accept our clients' pings
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
]


class LoadInterrupted(BaseException):
    """SIGINT or SIGTERM while the service loads (a BaseException: no `except Exception` swallows it)."""


class ShutdownSignal:
    """SIGINT and SIGTERM from the CLI's first line on (a restart or `docker stop` can come at any time).
    While the service loads, a signal raises LoadInterrupted in the main thread, so the start unwinds and
    the CLI releases what it made (shm pool files, TP followers) and exits 0, instead of dying by the
    signal; once `wait()` is called (serving), a signal only ends the wait, for a graceful shutdown."""

    def __init__(self):
        self._done = threading.Event()
        self._serving = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._done.set()
        if not self._serving:
            raise LoadInterrupted(signal.Signals(signum).name)

    def wait(self) -> None:
        """Block until SIGINT or SIGTERM (at once if one came since loading ended)."""
        self._serving = True
        self._done.wait()
