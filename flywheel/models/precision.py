"""Whether a device computes bfloat16 natively: the one test behind every
"auto" precision (the trainer's autocast, the dtype a launched rollout serves)."""

from __future__ import annotations

import os

import torch

#: oneDNN ISA caps (ONEDNN_MAX_CPU_ISA, or its old name DNNL_MAX_CPU_ISA) below AVX-512: oneDNN then has
#: no bfloat16 kernel, whatever the CPU could do.
_ONEDNN_CAPS_WITHOUT_BFLOAT16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI"})


def native_bfloat16(device: str) -> bool:
    """Whether `device` computes bfloat16 matmuls in hardware. A CPU without
    AVX-512 (or AMX) emulates them: measured on an AVX2 EPYC, a SmolLM2
    forward+backward under bfloat16 autocast took 27x as long as in float32.
    The same holds where oneDNN is told to stay below AVX-512 (its
    ONEDNN_MAX_CPU_ISA), as when an AVX2-only machine is imitated on a newer one."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if cap in _ONEDNN_CAPS_WITHOUT_BFLOAT16:
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
