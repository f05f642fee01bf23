"""Prefill service configuration: the CLI flags and their defaults (sized for a small CPU machine)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.grpc_server import DEFAULT_MAX_CHUNK_BYTES


@dataclass
class PrefillConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30001
    device: str = "cpu"
    dtype: str = "auto"
    max_total_tokens: int = 8192
    max_running_requests: int = 16
    chunked_prefill_size: int = 512
    context_length: int | None = None
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    torch_threads: int = 0
    test_kv_chunk_delay_s: float = 0.0   # test-only: sleep before each KV chunk


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prefill_service", description="The prefill service (gRPC).")
    p.add_argument("--model-path", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30001)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto = float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV slots of the prefill pool")
    p.add_argument("--max-running-requests", type=int, default=16, help="prompts prefilled together at most")
    p.add_argument("--chunked-prefill-size", type=int, default=512, help="token budget of one extend forward")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES, help="bound on one KV chunk")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    p.add_argument("--test-kv-chunk-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> PrefillConfig:
    return PrefillConfig(**vars(build_parser().parse_args(argv)))
