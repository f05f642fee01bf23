"""Prefill hooks: the one object through which tests and drills slow a prefill replica down or break it.

Production passes none: `PrefillService(config)` leaves `hooks` None, and the scheduler and the
handoff stream skip every hook with one `is None` test. A test or drill hands in an object instead,
`PrefillService(config, hooks=...)`, subclassing PrefillHooks and overriding what it needs:

    after_step()              the scheduler thread, after each worker step (before its answers go)
    await before_kv_message() the server's event loop, before each KV message of a stream is sent
    draw_fault()              once per call, as its KV is about to go: None, FAIL or STALL
    received(request)         the server's event loop, as a Prefill call's request arrives (before it is
                              checked): a drill may alter the message, e.g. a wrong kv_start_digest

A FAIL call ends with INTERNAL right after its first KV message; a STALL call sends nothing after it
and holds the call open (until the caller gives up, the server stops, or STALL_MAX_S passes), like
a wedged peer. Both land once decode has started writing the reserved slots. `Delays` is the plain
delay hook; fault_injection.py draws faults from a plan. None of this is a flag of the service:
bench/drill_prefill.py is the entry point that takes them on a command line.
This module runs without gRPC or torch: the scheduler imports it.
"""

from __future__ import annotations

import asyncio
import time

FAIL, STALL = "fail", "stall"
STALL_MAX_S = 600.0  # a stalled call ends by itself after this long at the latest


class PrefillHooks:
    """No-op base: each method does nothing; override the ones a test needs."""

    def after_step(self) -> None:
        """On the scheduler thread after each worker step, before the step's answers are given."""

    async def before_kv_message(self) -> None:
        """On the event loop before each KV message (a KvChunk or a KvWritten notice) is sent."""

    def draw_fault(self) -> str | None:
        """Once per call, as its KV is about to go: None (healthy), FAIL or STALL."""
        return None

    def received(self, request) -> None:
        """On the event loop as a Prefill call's request (a PrefillRequest message) arrives, before its checks."""


class Delays(PrefillHooks):
    """Sleep `step_s` after each worker step and `kv_message_s` before each KV message."""

    def __init__(self, step_s: float = 0.0, kv_message_s: float = 0.0):
        self.step_s, self.kv_message_s = step_s, kv_message_s

    def after_step(self) -> None:
        if self.step_s:
            time.sleep(self.step_s)

    async def before_kv_message(self) -> None:
        if self.kv_message_s:
            await asyncio.sleep(self.kv_message_s)
