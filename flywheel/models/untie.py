"""An untied copy of a model whose output head shares its input embeddings.

A LoRA adapter on the output head (Tinker's `train_unembed`, on by default)
changes the head alone. Merged into a model that ties the two, it has nowhere
to go: the merged head is a new `lm_head.weight` that no server of the tied
model loads. An untied copy (`tie_word_embeddings: false`, the head an
explicit copy of the embeddings) computes exactly what the tied model does,
and its head can take the adapter; the trainer and rollouts of the Tinker
gateway load it (docs/tinker.md).

    python -m flywheel.models untie SRC_DIR OUT_DIR

The command is a deployment's first-start step: it does nothing when OUT_DIR
holds a model, and links OUT_DIR to SRC_DIR when SRC_DIR does not tie them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def ties_embeddings(model_dir: str | Path) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def untie_embeddings(src: str | Path, out: str | Path) -> Path:
    """Writes the untied copy of `src` to `out` (built beside it and renamed: a half copy is never left);
    a model that does not tie them is refused (copy it as it is)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = Path(src), Path(out)
    if not ties_embeddings(src):
        raise ValueError(f"{src} does not tie its output head to its input embeddings: use it as it is")
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype="auto")
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
        for extra in ("generation_config.json", "chat_template.jinja"):
            if (src / extra).is_file() and not (tmp / extra).exists():
                shutil.copy2(src / extra, tmp / extra)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_untied(src: str | Path, out: str | Path) -> Path:
    """A model at `out` that does not tie its head: made once (`untie_embeddings`), or a link to `src`
    when `src` does not tie them; nothing is done when `out` holds a model already."""
    src, out = Path(src), Path(out)
    if (out / "config.json").is_file():
        return out
    if ties_embeddings(src):
        return untie_embeddings(src, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.symlink_to(os.path.relpath(src, out.parent), target_is_directory=True)
    return out
