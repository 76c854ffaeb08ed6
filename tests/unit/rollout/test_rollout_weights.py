"""Staging and verification of weight versions: nothing unverified gets through."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flywheel.codec import build_manifest, encode_state_dict
from flywheel.codec.errors import ChunkCorrupted, StreamTruncated
from flywheel.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from services.rollout.weights import MANIFEST_FILE, checkpoint_specs, stage_checkpoint, stage_stream


@pytest.fixture
def base_state(rollout_model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(rollout_model / "model.safetensors"))


def write_checkpoint(tmp_path: Path, state: dict[str, torch.Tensor], name: str = "ckpt") -> Path:
    out = tmp_path / name
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    return out


def test_specs_come_from_the_checkpoint_headers(rollout_model: Path, base_state) -> None:
    specs = checkpoint_specs(rollout_model)
    assert set(specs) == set(base_state)
    for name, t in base_state.items():
        assert specs[name].dtype == t.dtype and specs[name].shape == tuple(t.shape)


def test_a_matching_checkpoint_stages(tmp_path: Path, rollout_model: Path, base_state) -> None:
    path = write_checkpoint(tmp_path, {k: v * 2 for k, v in base_state.items()})
    staged = stage_checkpoint(path, 4, checkpoint_specs(rollout_model))
    assert staged.version == 4 and staged.files == [str(path / "model.safetensors")]
    assert staged.nbytes == sum(t.numel() * t.element_size() for t in base_state.values())


@pytest.mark.parametrize("defect", ["shape", "dtype", "missing", "extra"])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_tensor(tmp_path: Path, rollout_model: Path, base_state, defect: str) -> None:
    state = dict(base_state)
    name = "model.layers.0.mlp.up_proj.weight"
    if defect == "shape":
        state[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1])
    elif defect == "dtype":
        state[name] = state[name].to(torch.bfloat16)
    elif defect == "missing":
        del state[name]
    else:
        state["model.layers.9.extra.weight"] = torch.zeros(2)
    path = write_checkpoint(tmp_path, state)
    with pytest.raises(InvalidArgument) as info:
        stage_checkpoint(path, 2, checkpoint_specs(rollout_model))
    assert ("extra" if defect == "extra" else "up_proj") in str(info.value)


def test_truncated_file_and_missing_dir_are_refused(tmp_path: Path, rollout_model: Path, base_state) -> None:
    path = write_checkpoint(tmp_path, base_state)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(DataLoss, match="truncated"):
        stage_checkpoint(path, 2, checkpoint_specs(rollout_model))
    with pytest.raises(NotFound):
        stage_checkpoint(tmp_path / "nowhere", 2, checkpoint_specs(rollout_model))


def test_manifest_digest_catches_altered_bytes(tmp_path: Path, rollout_model: Path, base_state) -> None:
    path = write_checkpoint(tmp_path, base_state)
    (path / MANIFEST_FILE).write_bytes(build_manifest(base_state, 3).SerializeToString())
    stage_checkpoint(path, 3, checkpoint_specs(rollout_model))
    with pytest.raises(FailedPrecondition, match="version 3"):
        stage_checkpoint(path, 4, checkpoint_specs(rollout_model))
    altered = dict(base_state)
    altered["model.norm.weight"] = altered["model.norm.weight"] + 1e-3
    other = write_checkpoint(tmp_path, altered, "altered")
    shutil.copy(path / MANIFEST_FILE, other / MANIFEST_FILE)
    with pytest.raises(DataLoss, match="digest"):
        stage_checkpoint(other, 3, checkpoint_specs(rollout_model))


async def _stream(items):
    for item in items:
        yield item


async def test_stream_stages_intact_versions_only(rollout_model: Path, base_state) -> None:
    specs = checkpoint_specs(rollout_model)
    new = {k: v + 1 for k, v in base_state.items()}
    enc = encode_state_dict(new, 2, chunk_bytes=16 * 1024)
    staged = await stage_stream(2, _stream([enc.manifest, *enc.chunks()]), specs)
    assert all(torch.equal(staged.tensors[k], new[k]) for k in new)

    chunks = list(enc.chunks())
    data = bytearray(chunks[3].data)
    data[0] ^= 0xFF
    chunks[3].data = bytes(data)
    with pytest.raises(ChunkCorrupted) as info:
        await stage_stream(2, _stream([enc.manifest, *chunks]), specs)
    assert info.value.code == "DATA_LOSS"
    with pytest.raises(StreamTruncated):
        await stage_stream(2, _stream([enc.manifest, *list(enc.chunks())[:-1]]), specs)
    with pytest.raises(FailedPrecondition, match="asked for 5"):
        await stage_stream(5, _stream([enc.manifest]), specs)


async def test_stream_with_a_wrong_shape_is_refused_before_any_chunk(rollout_model: Path, base_state) -> None:
    bad = dict(base_state)
    bad["model.norm.weight"] = torch.ones(7)
    enc = encode_state_dict(bad, 2)
    received = []

    async def stream():
        yield enc.manifest
        for c in enc.chunks():
            received.append(c)
            yield c

    with pytest.raises(InvalidArgument, match="model.norm.weight"):
        await stage_stream(2, stream(), checkpoint_specs(rollout_model))
    assert received == []
