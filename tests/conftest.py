"""Shared fixtures: tiny checkpoints built once per session, and the HF oracle."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors under its interpreter, set before it loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common.tools.tiny_checkpoint import build
from tests.drills import is_drill

# name -> build() keyword arguments
CHECKPOINTS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "qwen2-tied": dict(arch="qwen2", tied=True),
    "qwen3-sharded": dict(arch="qwen3", shard_bytes=200_000),
    "qwen3-moe": dict(arch="qwen3_moe"),
    "deepseek-v3": dict(arch="deepseek_v3"),
    "deepseek-v3-nolora": dict(arch="deepseek_v3_nolora"),
    "deepseek-v3-mtp": dict(arch="deepseek_v3", mtp=True),  # deepseek-v3's target plus an MTP layer
    # deepseek-v3-mtp's layout in DeepSeek's block-quantized fp8 (blocks of 16 x 24: ragged edge blocks)
    "deepseek-v3-fp8": dict(arch="deepseek_v3", mtp=True, fp8_block=(16, 24)),
}


def pytest_configure(config):
    torch.set_num_threads(1)
    # the host's linear-layout tables (common/models/host_table.py): this session's own, shared by the
    # services it starts, not the user's, and pinned to tests/linear_layouts.json: a test's code path
    # never depends on the host's load (the tests of timing itself point the folder elsewhere)
    config.linear_table_dir = tempfile.mkdtemp(prefix="disagg-linear-tables-")
    os.environ["DISAGG_LINEAR_TABLE_DIR"] = config.linear_table_dir
    shutil.copy(
        os.path.join(os.path.dirname(__file__), "linear_layouts.json"),
        os.path.join(config.linear_table_dir, "fixed.json"),
    )


def pytest_collection_modifyitems(config, items):
    for item in items:  # the drill tier (tests/drills.py), before -m selects
        if is_drill(item.nodeid):
            item.add_marker(pytest.mark.drill)


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "linear_table_dir", ""), ignore_errors=True)


@pytest.fixture
def threads():
    """Sets each OpenMP team to `threads(n)` threads (the suite runs with one, as set above); restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ops():
    """The fused CPU ops (common/models/cpu_fused.py), built once; skips where they did not build."""
    from common.models import cpu_fused

    loaded = cpu_fused.load()
    if loaded is None:
        pytest.skip("the fused CPU ops did not build here (the log says why)")
    return loaded


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> path of a tiny checkpoint folder (built once per session)."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = build(str(tmp_path_factory.mktemp(name)), **CHECKPOINTS[name])
        return built[name]

    return get


@pytest.fixture(scope="session")
def fitted_head(checkpoint):
    """fitted_head(name, algorithm) -> a draft head folder fitted to the tiny checkpoint `name` by the
    fitting tool (bench.fit_eagle; a fixed step budget, seeded), cached on disk between sessions
    (tests/fitted_heads.py: $DISAGG_TEST_HEADS, else ~/.cache/disagg-serve/test-heads/)."""
    from tests.fitted_heads import fitted_head as fit

    built: dict[tuple[str, str], str] = {}

    def get(name: str, algorithm: str) -> str:
        if (name, algorithm) not in built:
            built[name, algorithm] = fit(checkpoint(name), algorithm)
        return built[name, algorithm]

    return get
