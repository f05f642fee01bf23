"""Tensors on the wire: dtype name + shape + raw little-endian bytes (bfloat16 as its 16-bit pattern)."""

from __future__ import annotations

import sys

import torch

from common.wire.proto_gen import prefill_pb2

_BY_NAME = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.float64, torch.uint8)
}
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
assert sys.byteorder == "little", "the wire format is little-endian"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode(t: torch.Tensor) -> prefill_pb2.Tensor:
    return encode_into(prefill_pb2.Tensor(), t)


def encode_into(msg: prefill_pb2.Tensor, t: torch.Tensor) -> prefill_pb2.Tensor:
    """Fill `msg` (a field of the message being built: building a Tensor apart and then assigning it
    into another message copies its bytes once more)."""
    t = t.detach().contiguous().cpu()
    raw = t.view(_SAME_WIDTH_INT[t.element_size()]) if t.dtype.is_floating_point else t
    msg.dtype = dtype_name(t.dtype)
    msg.shape[:] = list(t.shape)
    msg.data = raw.numpy().tobytes()
    return msg


def decode(msg: prefill_pb2.Tensor) -> torch.Tensor:
    dtype = _BY_NAME.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {msg.dtype!r}")
    shape = tuple(msg.shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = itemsize
    for n in shape:
        expected *= n
    if expected != len(msg.data):
        raise ValueError(f"tensor of shape {shape} {msg.dtype} needs {expected} bytes, got {len(msg.data)}")
    flat = (
        torch.frombuffer(bytearray(msg.data), dtype=_SAME_WIDTH_INT[itemsize])
        if expected
        else torch.empty(0, dtype=_SAME_WIDTH_INT[itemsize])
    )
    return flat.view(dtype).reshape(shape)
