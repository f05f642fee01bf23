"""GPU tests: marked `gpu`, skipped where CUDA is absent (CI has none). Run them on a GPU machine with
`python -m pytest tests/gpu -m gpu` (or the one command in the README, which also runs the bench)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(skip)
