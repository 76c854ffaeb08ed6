"""Staging and verification of weight versions: nothing unverified gets through."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from flywheel.codec import build_manifest, encode_state_dict
from flywheel.codec.errors import ChunkCorrupted, StreamTruncated
from flywheel.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import encoded_frames
from services.rollout.engine.checkpoint import check_stream_manifest, checkpoint_specs
from services.rollout.weights.verify import MANIFEST_FILE, stage_checkpoint
from flywheel.synchronizer import pull as pull_module
from flywheel.synchronizer.pull import MAX_RESUMES, pull_version
from tests.unit.synchronizer.sync_helpers import corrupt


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


class FrameCall:
    """A PullWeights call answering with given raw frames (an ordinary pull)."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames, self.sent, self.cancelled = frames, 0, False

    def __aiter__(self):
        return self._frames()

    async def _frames(self):
        for frame in self.frames:
            self.sent += 1
            yield frame

    def cancel(self) -> bool:
        self.cancelled = True
        return True


async def pull_frames(version: int, frames: list[bytes], specs) -> dict[str, torch.Tensor]:
    call = FrameCall(frames)
    try:
        _, tensors = await pull_version(
            lambda request: call, pb.PullWeightsRequest(version=version), synchronizer="test",
            check_manifest=lambda m: check_stream_manifest(version, m, specs),
        )
        return tensors
    finally:
        assert call.cancelled  # the call never outlives the pull


async def test_stream_stages_intact_versions_only(rollout_model: Path, base_state) -> None:
    specs = checkpoint_specs(rollout_model)
    new = {k: v + 1 for k, v in base_state.items()}
    frames = list(encoded_frames(encode_state_dict(new, 2, chunk_bytes=16 * 1024)))
    staged = await pull_frames(2, frames, specs)
    assert all(torch.equal(staged[k], new[k]) for k in new)

    with pytest.raises(ChunkCorrupted) as info:
        await pull_frames(2, [*frames[:3], corrupt(frames[3]), *frames[4:]], specs)
    assert info.value.code == "DATA_LOSS"
    with pytest.raises(StreamTruncated):
        await pull_frames(2, frames[:-1], specs)
    with pytest.raises(FailedPrecondition, match="asked for 5"):
        await pull_frames(5, frames, specs)


class UnreachedCall(FrameCall):
    """A call to a source that cannot be reached: UNAVAILABLE before anything arrives."""

    def __init__(self) -> None:
        super().__init__([])

    async def _frames(self):
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="failed to connect to all addresses")
        yield b""  # pragma: no cover - an async generator


@pytest.mark.parametrize("retry_unreached", [True, False])
async def test_a_source_that_cannot_be_reached_is_asked_again_only_when_there_is_no_other(
    retry_unreached: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The synchronizer may be restarting: it is asked again. A nearby relay or peer is not: the
    replica asks the next source at once (a gone peer cost a joining replica 36 s of retries)."""
    monkeypatch.setattr(pull_module, "resume_delay", lambda attempt: 0.0)
    calls: list[UnreachedCall] = []

    def open_call(request):
        calls.append(UnreachedCall())
        return calls[-1]

    with pytest.raises(grpc.aio.AioRpcError):
        await pull_version(open_call, pb.PullWeightsRequest(version=1), synchronizer="gone",
                           retry_unreached=retry_unreached)
    assert len(calls) == (1 + MAX_RESUMES if retry_unreached else 1)
    assert all(call.cancelled for call in calls)


async def test_stream_with_a_wrong_shape_is_refused_before_any_chunk(rollout_model: Path, base_state) -> None:
    bad = dict(base_state)
    bad["model.norm.weight"] = torch.ones(7)
    call = FrameCall(list(encoded_frames(encode_state_dict(bad, 2))))
    with pytest.raises(InvalidArgument, match="model.norm.weight"):
        await pull_version(
            lambda request: call, pb.PullWeightsRequest(version=2), synchronizer="test",
            check_manifest=lambda m: check_stream_manifest(2, m, checkpoint_specs(rollout_model)),
        )
    assert call.sent == 1 and call.cancelled  # the manifest only
