"""The tiny random-initialised model and its locally trained tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from flywheel.models.tiny import HEAD_DIM, build_tiny_model
from flywheel.models.tokenizer import ENDOFTEXT, IM_END, IM_START


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def test_writes_a_complete_hf_directory(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names


def test_files_are_readable_by_others(tiny_dir: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for path in tiny_dir.iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name


def test_config_shape(tiny_dir: Path, tokenizer) -> None:
    config = AutoConfig.from_pretrained(tiny_dir)
    assert config.model_type == "qwen2"
    assert config.head_dim == HEAD_DIM == 64
    assert config.hidden_size == config.num_attention_heads * 64
    assert config.vocab_size == len(tokenizer)
    assert 256 < config.vocab_size <= 2048
    assert config.max_position_embeddings == 2048
    assert config.eos_token_id == tokenizer.eos_token_id


def test_generation_config_stops_on_end_of_text_and_end_of_turn(tiny_dir: Path, tokenizer) -> None:
    eos = json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"]
    assert set(eos) == {
        tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        tokenizer.convert_tokens_to_ids(IM_END),
    }


def test_forward_gives_finite_logits_over_the_vocab(model, tokenizer) -> None:
    inputs = tokenizer("What is 12 + 7? The answer is 19.", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    # Random init, not collapsed: the next-token distribution is not one-hot.
    assert logits[0, -1].std() > 0


def test_same_arguments_give_identical_files(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for path in sorted(tiny_dir.iterdir()):
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name


def test_another_seed_gives_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (
        tiny_dir / "model.safetensors"
    ).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_llama_in_bfloat16(tmp_path: Path) -> None:
    out = build_tiny_model(
        tmp_path / "llama",
        arch="llama",
        num_layers=1,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        dtype="bfloat16",
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama"
    assert model.config.hidden_size == 256 and model.config.head_dim == 64
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 64}, "head dimension"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"arch": "gpt2"}, "arch"),
        ({"dtype": "float16"}, "dtype"),
    ],
)
def test_rejects_bad_shapes(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tiny_model(tmp_path, **kwargs)


@pytest.mark.parametrize(
    "text",
    ["What is 12 + 7? The answer is 19.", " spaces\tand\nnewlines ", "héllo wörld 🙂 数学", ""],
)
def test_tokenizer_round_trips_text(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_splits_digits_and_keeps_special_tokens_whole(tokenizer) -> None:
    ids = tokenizer.encode("12345")
    assert len(ids) == 5
    assert tokenizer.encode(f"{IM_START}user") == [
        tokenizer.convert_tokens_to_ids(IM_START)
    ] + tokenizer.encode("user")
    assert tokenizer.eos_token == tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.bos_token is None
    # Frequent corpus words are single tokens: the BPE merges were learned.
    assert len(tokenizer.encode(" answer")) == 1


def test_chat_template_renders_turns_and_generation_prompt(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 + 4?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
        "<|im_start|>user\nAnd 4 + 4?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    assert tokenizer.decode(ids["input_ids"]) == text


def test_chat_template_renders_tools_and_tool_calls(tokenizer) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
    messages = [
        {"role": "user", "content": "What is 6 * 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'},
                }
            ],
        },
        {"role": "tool", "content": "42"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=[tool], tokenize=False, add_generation_prompt=True
    )
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n")
    assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in system
    assert rest == (
        "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
