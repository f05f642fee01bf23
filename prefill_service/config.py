"""Prefill service configuration: every flag and its default, declared once (sized for a small CPU machine).

The shared groups (common/service_config.py) and prefill's own: the scheduler and the Prefill calls.
Test hooks (delays, injected faults) are no flags: tests hand PrefillService a hooks object (hooks.py)."""

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
class PrefillConfig(ServiceConfig, PrefillSchedulerFlags, PrefillCallFlags):
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
