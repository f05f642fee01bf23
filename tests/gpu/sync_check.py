"""`no_sync()`: a block of CUDA work in which any host sync raises (torch's sync debug mode), for the
GPU tests that prove a kernel or a forward never waits for the device on the host."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
