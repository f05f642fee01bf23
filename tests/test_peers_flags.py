"""bench.peers_bench's names for our engines: the format and the KV dtype each name gives both services."""

from __future__ import annotations

import pytest

from bench.peers_bench import our_flags


@pytest.mark.parametrize(
    "engine,flags",
    [
        ("ours", []),
        ("ours-w8a8", ["--quantization", "w8a8"]),  # its KV: auto, bf16 with a format
        ("ours-w8a8+kv-f32", ["--quantization", "w8a8", "--kv-cache-dtype", "float32"]),
        ("ours+kv-bf16", ["--kv-cache-dtype", "bfloat16"]),
        ("ours-bf16-matmul+kv-bf16", ["--quantization", "bf16-matmul", "--kv-cache-dtype", "bfloat16"]),
        ("vllm", None),
        ("ours-int4", None),
        ("ours+kv-fp8", None),
    ],
)
def test_our_engine_names_give_both_services_flags(engine, flags):
    assert our_flags(engine) == flags
