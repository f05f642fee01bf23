"""Tensors on the wire: dtype name + shape + raw little-endian bytes (bfloat16 as its 16-bit pattern)."""

from __future__ import annotations

import sys
import warnings

import torch

from common.wire.proto_gen import prefill_pb2

_BY_NAME = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.float64, torch.uint8)
}
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
assert sys.byteorder == "little", "the wire format is little-endian"
# decode(readonly=True) views a bytes object, which torch calls non-writable: we never write it.
# Filtered once here: warnings.catch_warnings around each call is not thread-safe.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


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


def nbytes(msg: prefill_pb2.Tensor) -> int:
    """The payload's size as its dtype and shape say (reading `msg.data` would copy it)."""
    dtype = _BY_NAME.get(msg.dtype)
    n = torch.empty(0, dtype=dtype).element_size() if dtype is not None else 0
    for d in msg.shape:
        n *= d
    return n


def decode(msg: prefill_pb2.Tensor, readonly: bool = False) -> torch.Tensor:
    """The tensor of `msg`. With `readonly` it is a view of the payload's bytes object, which must
    not be written (a KV chunk on its way into the pool): reading a bytes field copies it once, and a
    writable copy of those 1-2 MB cost 10x that again (fresh pages). Else a writable copy."""
    dtype = _BY_NAME.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {msg.dtype!r}")
    shape, itemsize, expected = tuple(msg.shape), torch.empty(0, dtype=dtype).element_size(), nbytes(msg)
    data = msg.data  # a copy of the field each time it is read
    if expected != len(data):
        raise ValueError(f"tensor of shape {shape} {msg.dtype} needs {expected} bytes, got {len(data)}")
    if not expected:
        return torch.empty(shape, dtype=dtype)
    if readonly:
        flat = torch.frombuffer(data, dtype=_SAME_WIDTH_INT[itemsize])
    else:
        flat = torch.frombuffer(bytearray(data), dtype=_SAME_WIDTH_INT[itemsize])
    return flat.view(dtype).reshape(shape)
