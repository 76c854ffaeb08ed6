"""The machine a bench ran on, for its JSON line: figures from different CPUs differ by
several times (bfloat16 native with AVX-512/AMX, emulated on AVX2-only machines), so
every published figure names its CPU."""

from __future__ import annotations

import os
import platform
from pathlib import Path

#: Instruction-set features that change our CPU figures, best first.
_ISA_LADDER = (("amx_bf16", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2"))

#: The /proc/cpuinfo flags a bench record keeps (the ones that move our figures).
RECORDED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; the platform's name and no flags elsewhere."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return model, flags


def describe() -> dict[str, object]:
    """cpu_model, cpu_isa (amx | avx512_bf16 | avx512 | avx2 | other), cpu_flags (those of
    RECORDED_FLAGS it has), cpu_cores; without importing torch."""
    model, flags = _cpuinfo()
    return {"cpu_model": model, "cpu_isa": next((name for flag, name in _ISA_LADDER if flag in flags), "other"),
            "cpu_flags": [flag for flag in RECORDED_FLAGS if flag in flags], "cpu_cores": os.cpu_count()}


def cpu() -> dict[str, object]:
    """cpu_model, cpu_isa (amx | avx512_bf16 | avx512 | avx2 | other), torch's kernel capability, cores."""
    here = describe()
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - a figure, never a failure
        capability = "unknown"
    return {"cpu_model": here["cpu_model"], "cpu_isa": here["cpu_isa"], "torch_cpu_capability": capability,
            "cpu_cores": here["cpu_cores"]}
