"""Where a handoff's KV is staged, and how a transfer thread waits for it and copies it.

The prefill worker copies each finished prompt's KV out of its pool into the memory the sender
asks for (`KvSender.staging_device`): host memory for gRPC bytes and shm (they read it with the
CPU), the pool's own device for Mooncake. The copy-out runs on the scheduler thread right after
the forward and does not wait for the device: it makes a `StagedHandoff`, the record plus
`kv_ready` (on CUDA an event recorded after its copies), and the transfer thread waits for that
event (`wait_ready`) before anything reads the KV; what leaves the prefill side is the plain record.
A reader that needs host memory (the bytes fallback, Mooncake's TCP transport) copies the KV off
the device on the transfer thread (`host_handoff`: one copy per layer into pinned memory), not on
the scheduler thread; Mooncake over RDMA registers the device memory itself (GPUDirect). Device
work of a transfer thread (those copies, a tensor-parallel rank's slice of the heads) runs on a
stream of its own (`side_stream`), so it never queues behind the next forward, and is finished
before the KV leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from common.engine.handoff import Handoff

HOST = torch.device("cpu")


@dataclass
class StagedHandoff(Handoff):
    """A handoff as the prefill worker made it, before it leaves: the record, its KV on the staging
    device, and `kv_ready`: a CUDA event recorded after the copy-out (None: ready now)."""

    kv_ready: object | None = None

    def record(self, **changes) -> Handoff:
        """The plain record (what the decode side gets), with `changes`."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Handoff)}
        return Handoff(**(fields | changes))


def copied_out(device: torch.device):
    """What `kv_ready` holds after a copy-out to `device`: on CUDA an event recorded on the current
    stream; None on the host, where the copies are done when they return."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_ready(handoff) -> None:
    """Block this (transfer) thread until the handoff's KV copy-out is done; at once on the host."""
    ready = getattr(handoff, "kv_ready", None)
    if ready is not None:
        ready.synchronize()


@contextlib.contextmanager
def side_stream(device: torch.device):
    """Device work of a transfer thread: on CUDA on a fresh stream, finished when the block ends
    (the caller waited for `kv_ready` first); elsewhere nothing changes."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def on_host(tensors: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """`tensors` as host tensors: themselves when they are (no copy), else a copy of each in pinned
    memory, made on a side stream (call `wait_ready` first)."""
    if tensors is None or all(t.device.type == "cpu" for t in tensors):
        return tensors
    with side_stream(tensors[0].device):
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for dst, src in zip(out, tensors):
            dst.copy_(src, non_blocking=True)
    return out


def host_handoff(handoff: Handoff) -> Handoff:
    """The handoff with its KV (the target's and the head's) in host memory: itself when it is
    there, else the plain record of a staged one, its KV copied off the device (waits for the copy-out)."""
    if handoff.k[0].device.type == "cpu":
        return handoff
    wait_ready(handoff)
    return handoff.record(
        k=on_host(handoff.k), v=on_host(handoff.v), draft_k=on_host(handoff.draft_k), draft_v=on_host(handoff.draft_v)
    )
