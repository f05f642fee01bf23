"""Decode service configuration: the CLI flags and their defaults (sized for a small CPU machine)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class DecodeConfig:
    model_path: str
    prefill_addr: str = "127.0.0.1:30001"
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "auto"
    max_total_tokens: int = 16384
    max_running_requests: int = 32
    default_max_new_tokens: int = 128
    served_model_name: str | None = None
    disable_overlap_schedule: bool = False
    context_length: int | None = None
    prefill_wait_s: float = 30.0
    prefill_timeout_s: float = 600.0
    torch_threads: int = 0

    @property
    def prefill_addrs(self) -> list[str]:
        return [a.strip() for a in self.prefill_addr.split(",") if a.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode_service",
                                description="The decode service: the client-facing front door (gRPC SglangScheduler).")
    p.add_argument("--model-path", required=True, help="Hugging Face checkpoint folder (same model as prefill)")
    p.add_argument("--prefill-addr", default="127.0.0.1:30001", help="HOST:PORT[,HOST:PORT...] of prefill replicas")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto = float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV slots of the decode pool")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--default-max-new-tokens", type=int, default=128,
                   help="used when a request gives none (clamped to the context)")
    p.add_argument("--served-model-name", default=None, help="model id reported to clients (default: folder name)")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--prefill-wait-s", type=float, default=30.0, help="how long to wait for a prefill replica")
    p.add_argument("--prefill-timeout-s", type=float, default=600.0, help="deadline of one Prefill call")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    return p


def parse_args(argv=None) -> DecodeConfig:
    return DecodeConfig(**vars(build_parser().parse_args(argv)))
