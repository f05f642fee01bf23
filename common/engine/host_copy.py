"""Host values to the device without stalling the host: `to_device`.

On CUDA a copy from pageable host memory is synchronous for the host (it waits until the stream
reaches it, so a schedule-side copy would wait for forward N and cancel the overlap). `to_device`
stages host data in pinned memory and copies it with `non_blocking=True`, ordered on the current
stream (inside stream work: the forward stream). The caching host allocator keeps a pinned block
until the copies that read it are done, so callers may drop their references at once. On CPU the
host tensor is used as is (no copy).
"""

from __future__ import annotations

import torch


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A list, number or tensor -> a tensor on `device` (with `dtype` if given)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device == device:
        return t if t.device == device else t.to(device)
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
