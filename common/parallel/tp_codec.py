"""The bytes of a TP message: tensors and plain data only, so reading a message never runs code.

`dumps(obj)` accepts None, bool, int, float, str, bytes, list, tuple, dict, torch.device, tensors of
the dtypes in `_DTYPES`, and instances of the plain-data classes in `MESSAGE_TYPES` (their fields,
recursively); anything else is a TypeError on the sender. `loads(data, device)` rebuilds it (tensors
on `device`); a class is looked up in `MESSAGE_TYPES` by name and filled in field by field (no
constructor, no import by name), so a crafted message can name nothing else.

Layout: 4-byte header length, the header (JSON: the value tree, tensors as indexes into a table of
dtype, shape and offset), then each tensor's bytes (16-byte aligned).
"""

from __future__ import annotations

import importlib
import json
import struct

import torch

# The classes a TP message may hold (module, class name): dataclasses / NamedTuples / plain classes
# made of fields only. Add one here when a new one travels (the sender says which is missing).
MESSAGE_TYPES = (
    ("common.engine.handoff", "Handoff"),
    ("common.engine.handoff", "HandoffRequest"),
    ("common.engine.sampling", "SamplingParams"),
    ("common.engine.sampling", "SamplingBatch"),
    ("common.engine.spec_sampling", "SpecDraws"),
    ("common.engine.penalties", "LogitProcessors"),  # cached on a SamplingBatch once a step used them
    ("common.engine.logprobs", "LogprobRows"),
    ("common.engine.logprobs", "TokenLogprobs"),  # a Handoff's first_logprobs
    ("prefill_service.tp_messages", "Admit"),
    ("prefill_service.tp_messages", "Abort"),
    ("prefill_service.tp_messages", "FailAll"),
    ("prefill_service.tp_messages", "Step"),
    ("prefill_service.tp_messages", "Stop"),
    ("decode_service.worker_batch", "WorkerBatch"),
    ("decode_service.worker_batch", "Lane"),
    ("decode_service.tp_messages", "Forward"),
    ("decode_service.tp_messages", "WriteKvChunk"),
    ("decode_service.handoff_writes", "ForkSeed"),
    ("decode_service.tp_messages", "WritePrebuilt"),
    ("decode_service.tp_messages", "ExtendRow"),
    ("decode_service.tp_messages", "ReleaseRow"),
    ("decode_service.tp_messages", "Stop"),
)
_DTYPES = {
    str(d): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}
_ALIGN = 16
_classes: dict[str, type] | None = None


def _types() -> dict[str, type]:
    global _classes
    if _classes is None:
        _classes = {f"{m}.{n}": getattr(importlib.import_module(m), n) for m, n in MESSAGE_TYPES}
    return _classes


class _Writer:
    def __init__(self):
        self.table, self.chunks, self.offset = [], [], 0
        self.names = {cls: name for name, cls in _types().items()}

    def tensor(self, t: torch.Tensor) -> dict:
        if str(t.dtype) not in _DTYPES:
            raise TypeError(f"a TP message cannot carry {t.dtype} tensors (allowed: {', '.join(_DTYPES)})")
        raw = memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
        pad = -self.offset % _ALIGN
        self.chunks += [bytes(pad), raw]  # views: copied once, into dumps' output
        self.table.append([str(t.dtype), list(t.shape), self.offset + pad])
        self.offset += pad + len(raw)
        return {"T": len(self.table) - 1}

    def value(self, v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        name = self.names.get(type(v))
        if name is not None:  # a NamedTuple's fields are its items; other classes' their __dict__
            fields = v._asdict() if isinstance(v, tuple) else vars(v)
            return {"o": name, "f": {k: self.value(x) for k, x in fields.items()}}
        if isinstance(v, (list, tuple)):  # a tuple subclass (torch.Size) travels as a tuple
            return {"l" if isinstance(v, list) else "t": [self.value(x) for x in v]}
        if isinstance(v, dict):
            return {"d": [[self.value(k), self.value(x)] for k, x in v.items()]}
        if isinstance(v, bytes):
            return {"b": v.hex()}
        if isinstance(v, torch.device):
            return {"dev": str(v)}
        raise TypeError(
            f"a TP message cannot carry a {type(v).__module__}.{type(v).__qualname__}: tensors and plain data "
            "only (add a plain-data class to MESSAGE_TYPES in common/parallel/tp_codec.py)"
        )


def dumps(obj) -> bytearray:
    w = _Writer()
    header = json.dumps({"v": w.value(obj), "t": w.table}, separators=(",", ":")).encode()
    out = bytearray(struct.pack("<I", len(header)) + header)
    for chunk in w.chunks:
        out += chunk
    return out


def _tensor(body: memoryview, entry, device: torch.device) -> torch.Tensor:
    dtype_name, shape, offset = entry
    dtype = _DTYPES[dtype_name]  # KeyError: not an allowed dtype
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if offset < 0 or offset % _ALIGN or offset + n > len(body):
        raise ValueError(f"a TP message's tensor lies outside its body ({offset}+{n} of {len(body)} bytes)")
    flat = torch.frombuffer(body, dtype=torch.uint8, count=n, offset=offset)
    return flat.view(dtype).reshape(shape).to(device)


def _value(v, tensors: list, classes: dict):
    if not isinstance(v, (dict, list)):
        return v
    if isinstance(v, list):
        raise ValueError("a TP message's header has a bare list")
    if "o" in v:
        cls = classes[v["o"]]  # KeyError: a class outside MESSAGE_TYPES
        fields = {k: _value(i, tensors, classes) for k, i in v["f"].items()}
        if issubclass(cls, tuple):
            return cls(**fields)
        obj = cls.__new__(cls)
        obj.__dict__.update(fields)  # field by field: no constructor runs (frozen dataclasses too)
        return obj
    ((tag, x),) = v.items()
    if tag == "T":
        return tensors[x]
    if tag in ("l", "t"):
        items = [_value(i, tensors, classes) for i in x]
        return items if tag == "l" else tuple(items)
    if tag == "d":
        return {_value(k, tensors, classes): _value(i, tensors, classes) for k, i in x}
    if tag == "b":
        return bytes.fromhex(x)
    if tag == "dev":
        return torch.device(x)
    raise ValueError(f"a TP message's header has an unknown entry {v!r:.80}")


def loads(data, device: torch.device):
    """The object `dumps` made, its tensors on `device`; ValueError for anything else. `data`: a
    writable buffer the message's CPU tensors may keep using (not copied)."""
    try:
        data = memoryview(data)
        (size,) = struct.unpack_from("<I", data)
        header = json.loads(bytes(data[4 : 4 + size]))
        body = data[4 + size :]
        tensors = [_tensor(body, e, device) for e in header["t"]]
        return _value(header["v"], tensors, _types())
    except (KeyError, TypeError, ValueError, IndexError, struct.error, RuntimeError) as e:
        raise ValueError(f"malformed TP message ({type(e).__name__}: {e}): it was not made by tp_codec.dumps") from e
