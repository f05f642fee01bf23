"""Prefill service configuration: every flag and its default, declared once (sized for a small CPU machine).

The shared groups (common/service_config.py) and prefill's own: the scheduler, the Prefill calls
and the test hooks."""

from __future__ import annotations

from dataclasses import dataclass

from common.service_config import FlagGroup, ServiceConfig, flag, parse_config
from common.service_config import build_parser as _build
from common.wire.grpc_server import DEFAULT_MAX_CHUNK_BYTES

PROG, DESCRIPTION = "python -m prefill_service", "The prefill service (gRPC disagg.v1.Prefill)."


@dataclass(kw_only=True)
class PrefillSchedulerFlags(FlagGroup, title="scheduler"):
    """How prompts are prefilled: chunk budget and prefix cache."""

    chunked_prefill_size: int = flag(512, "token budget of one extend forward")
    disable_radix_cache: bool = flag(False, "compute every prompt in full (no prefix cache between requests)")


@dataclass(kw_only=True)
class PrefillCallFlags(FlagGroup, title="prefill calls"):
    """The Prefill calls decode makes: how many may be open, how large a KV chunk on the wire."""

    max_chunk_bytes: int = flag(
        DEFAULT_MAX_CHUNK_BYTES,
        "bound on one KV chunk on the wire (at most 32 MiB); a request may ask for its own within [256 KiB, 32 MiB]",
    )
    max_open_calls: int = flag(
        256,
        "Prefill calls open at once (queued, prefilling or sending KV), also counting calls still queued; "
        "more: RESOURCE_EXHAUSTED",
    )


@dataclass(kw_only=True)
class TestHooks(FlagGroup, title="test hooks"):
    """Faults and delays for tests and drills."""

    __test__ = False  # not a pytest test class

    inject_faults: str | None = flag(
        None,
        "tests and drills: break or stall a fraction of handoffs, e.g. fail=0.05,stall=0.02[,seed=1] (default off)",
        type=str,
    )
    test_step_delay_s: float = flag(0.0, "test-only: sleep after each engine step", hidden=True)
    test_kv_chunk_delay_s: float = flag(0.0, "test-only: sleep before each KV chunk", hidden=True)


@dataclass(kw_only=True)
class PrefillConfig(ServiceConfig, PrefillSchedulerFlags, PrefillCallFlags, TestHooks):
    port: int = flag(30001, "port to bind (0 = any free port)")
    max_total_tokens: int = flag(8192, "KV slots of the prefill pool")
    max_running_requests: int = flag(16, "prompts prefilled together at most")

    def decode_step_args(self) -> dict:
        """Prefill runs no decode steps: RunnerArgs' defaults (no graphs, nothing compiled, KV in memory)."""
        return {}


def build_parser():
    return _build(PrefillConfig, PROG, DESCRIPTION)


def parse_args(argv=None) -> PrefillConfig:
    return parse_config(PrefillConfig, PROG, DESCRIPTION, argv)
