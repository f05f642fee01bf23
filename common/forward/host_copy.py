"""Host values to the device and results back without stalling the host: `to_device`, `to_host`.

On CUDA a copy from pageable host memory is synchronous for the host (it waits until the stream
reaches it, so a schedule-side copy would wait for forward N and cancel the overlap). `to_device`
stages host data in pinned memory and copies it with `non_blocking=True`, ordered on the current
stream (inside stream work: the forward stream). The caching host allocator keeps a pinned block
until the copies that read it are done, so callers may drop their references at once. On CPU the
host tensor is used as is (no copy). `to_host` copies a step's results back into pinned memory with a
non-blocking copy (pageable memory would make the copy synchronous); read it after the step's
results-ready event.
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


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor -> a host tensor filled by a non-blocking copy into pinned memory (CUDA); a
    host tensor as is."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)
