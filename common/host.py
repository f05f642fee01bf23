"""The host a figure was measured on: CPU model, the vector ISA torch uses, AMX where present."""

from __future__ import annotations

import functools
import platform

import torch


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (empty off Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


@functools.cache
def describe() -> str:
    """e.g. 'AMD EPYC 7B13 (AVX2)' or 'Intel(R) Xeon(R) Platinum 8481C (AVX512, AMX)'."""
    info = _cpuinfo()
    model = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    isa = [torch.backends.cpu.get_cpu_capability()]
    if "amx_tile" in info.get("flags", "").split():
        isa.append("AMX")
    return f"{model} ({', '.join(isa)})"
