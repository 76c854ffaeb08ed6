"""Checkpoints: exact resume, HF-loadable model dirs, atomicity, keep-last-K, LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flywheel.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from services.trainer import checkpoints
from services.trainer.forward import token_logprobs
from services.trainer.loss_request import LossRequest
from tests.unit.trainer.trainer_helpers import (
    make_batch,
    optimizer_state,
    parameters,
    same_tensors,
)

LOSS = LossRequest(kind="dapo", is_cap=2.0, entropy_coef=0.001)


def test_resume_is_exact(make_engine, tmp_path: Path) -> None:
    batch = make_batch()
    first = make_engine(optimizer={"warmup_steps": 2, "schedule": "cosine", "total_steps": 10})
    for _ in range(3):
        first.train_step(batch, LOSS)
    path, step, size = first.save_checkpoint(client_state=b"cursor=42")
    assert (path.name, step) == ("global_step_3", 3) and size > 0
    torch.rand(5)  # the uninterrupted run draws from the RNG after the save too
    uninterrupted = [first.train_step(batch, LOSS).metrics for _ in range(2)]

    second = make_engine(optimizer={"warmup_steps": 2, "schedule": "cosine", "total_steps": 10})
    loaded, step, version, client_state = second.load_checkpoint(latest=True)
    assert (loaded, step, version, client_state) == (path, 3, 3, b"cursor=42")
    resumed = [second.train_step(batch, LOSS).metrics for _ in range(2)]
    for a, b in zip(uninterrupted, resumed):
        assert a["loss"] == b["loss"] and a["learning_rate"] == b["learning_rate"]
    assert same_tensors(parameters(first), parameters(second))
    assert same_tensors(optimizer_state(first), optimizer_state(second))


def test_model_dir_loads_with_from_pretrained(make_engine) -> None:
    engine = make_engine()
    batch = make_batch()
    engine.train_step(batch, LOSS)
    path, _, _ = engine.save_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path / "model")
    with torch.no_grad():
        theirs, _ = token_logprobs(model.eval(), batch["input_ids"], batch["attention_mask"])
    ours, _ = engine.compute_logprobs(batch)
    assert torch.equal(theirs, ours)
    assert (path / "model" / "tokenizer.json").is_file()
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["weight_version"] == 1


def test_only_complete_checkpoints_count(make_engine, tmp_path: Path) -> None:
    engine = make_engine()
    parent = engine.config.checkpoint.dir
    engine.train_step(make_batch(), LOSS)
    path, _, _ = engine.save_checkpoint()
    # What a crash can leave behind: a temp dir, and a dir without the final state file.
    (parent / ".tmp-global_step_7-abc").mkdir()
    (parent / "global_step_9").mkdir()
    assert checkpoints.latest(parent) == path
    with pytest.raises(InvalidArgument, match="not a complete checkpoint"):
        engine.load_checkpoint(parent / "global_step_9")
    with pytest.raises(NotFound):
        engine.load_checkpoint(parent / "global_step_404")
    engine.save_checkpoint()  # same step again: replaced, stale temp dirs swept
    assert not (parent / ".tmp-global_step_7-abc").exists()
    assert [p.name for _, p in checkpoints.list_checkpoints(parent)] == ["global_step_1"]


def test_latest_with_none_saved(make_engine) -> None:
    engine = make_engine()
    assert engine.load_checkpoint(latest=True) == (None, 0, 0, b"")
    with pytest.raises(InvalidArgument, match="path"):
        engine.load_checkpoint()


def test_keep_last_and_remove_previous(make_engine, tmp_path: Path) -> None:
    engine = make_engine(checkpoint={"keep_last": 2, "allowed_roots": [str(tmp_path / "elsewhere")]})
    parent = engine.config.checkpoint.dir
    for _ in range(3):
        engine.train_step(make_batch(), LOSS)
        engine.save_checkpoint()
    assert [s for s, _ in checkpoints.list_checkpoints(parent)] == [2, 3]
    engine.train_step(make_batch(), LOSS)
    other = tmp_path / "elsewhere"
    engine.save_checkpoint(directory=other)
    engine.train_step(make_batch(), LOSS)
    engine.save_checkpoint(directory=other, remove_previous=True)
    assert [s for s, _ in checkpoints.list_checkpoints(other)] == [5]


def test_request_paths_stay_inside_the_checkpoint_directories(make_engine, tmp_path: Path) -> None:
    engine = make_engine()
    engine.train_step(make_batch(), LOSS)
    outside = tmp_path / "outside"
    for bad, error in [(outside, PermissionDenied), (Path("../outside"), PermissionDenied),
                       (Path("ck\0pt"), InvalidArgument), (Path("n" * 300), InvalidArgument)]:
        with pytest.raises(error):
            engine.save_checkpoint(directory=bad)
        with pytest.raises(error):
            engine.load_checkpoint(bad)
    assert not outside.exists() and not (tmp_path / "ckpt").exists(), "nothing was written"
    # A relative path is taken inside checkpoint.dir, as is the default.
    path, step, _ = engine.save_checkpoint(directory=Path("mine"))
    assert path == (tmp_path / "ckpt" / "mine" / f"global_step_{step}").resolve()
    assert engine.load_checkpoint(Path("mine") / path.name)[1] == step


def test_a_corrupt_checkpoint_is_rejected_without_changes(make_engine) -> None:
    engine = make_engine()
    engine.train_step(make_batch(), LOSS)
    path, _, _ = engine.save_checkpoint()
    engine.train_step(make_batch(), LOSS)
    params, opt = parameters(engine), optimizer_state(engine)
    weights = path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(DataLoss, match="model.safetensors"):
        engine.load_checkpoint(path)
    assert same_tensors(parameters(engine), params) and same_tensors(optimizer_state(engine), opt)
    assert engine.info().step == 2


def test_lora_trains_only_adapters_and_exports_merged_weights(make_engine) -> None:
    lora = {"lora": {"enabled": True, "rank": 4, "alpha": 8.0}}
    engine = make_engine(model=lora, optimizer={"lr": 1e-2})
    info = engine.info()
    assert 0 < info.trainable_count < info.parameter_count
    trainable = [n for n, p in engine.policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in engine.policy.model.named_parameters() if not p.requires_grad}

    batch = make_batch()
    for _ in range(2):
        engine.train_step(batch, LOSS)
    assert all(torch.equal(p, frozen[n]) for n, p in engine.policy.model.named_parameters() if n in frozen)
    reference, _ = engine.compute_logprobs(batch, reference=True)  # adapters switched off
    policy, _ = engine.compute_logprobs(batch)
    assert not torch.allclose(reference, policy)

    path, _, _ = engine.save_checkpoint()
    merged = AutoModelForCausalLM.from_pretrained(path / "model")
    with torch.no_grad():
        theirs, _ = token_logprobs(merged.eval(), batch["input_ids"], batch["attention_mask"])
    assert torch.allclose(theirs, policy, atol=1e-5)
    assert (path / "adapter" / "adapter_config.json").is_file()

    after_save = engine.train_step(batch, LOSS).metrics["loss"]
    resumed = make_engine(model=lora, optimizer={"lr": 1e-2})
    resumed.load_checkpoint(path)
    assert resumed.train_step(batch, LOSS).metrics["loss"] == after_save
    assert same_tensors(parameters(engine), parameters(resumed))

    full = make_engine()
    with pytest.raises(FailedPrecondition, match="lora"):
        full.load_checkpoint(path)


def test_resume_latest_at_startup(make_engine) -> None:
    engine = make_engine()
    engine.train_step(make_batch(), LOSS)
    engine.save_checkpoint(client_state=b"x")
    restarted = make_engine(checkpoint={"resume_latest": True})
    info = restarted.info()
    assert (info.step, info.weight_version) == (1, 1)
    assert same_tensors(parameters(engine), parameters(restarted))
