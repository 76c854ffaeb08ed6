"""SQLite persistence round trip, and checkpoint directory verification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flywheel.codec import build_manifest
from flywheel.errors import DataLoss, FailedPrecondition, NotFound
from services.synchronizer.checkpoints import INDEX_FILE, MANIFEST_FILE, verify_checkpoint
from services.synchronizer.store import Store
from flywheel.synchronizer.types import Component, Identity, Method, Policy, Role, State, Style
from services.synchronizer.versions import VersionRecord
from tests.unit.synchronizer.sync_helpers import small_state


def test_store_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sync.sqlite3"
    store = Store(path)
    c = Component(
        Identity(Role.ROLLOUT, "r0", "10.0.0.2:1", frozenset({Method.NCCL, Method.MEMORY}), {"zone": "a"}),
        state=State.REQUIRE_SYNC, step=12, weight_version=10, last_heartbeat_ms=5, last_sync_step=10, awaited_version=11,
    )
    store.save_component(c)
    c.step = 13
    store.save_component(c)  # replaces
    store.save_version(VersionRecord(10, Method.MEMORY, 1234, "", 99))
    store.save_version(VersionRecord(11, Method.CHECKPOINT, 55, "/ckpt/11", 100))
    store.save_policy(Policy(Style.DYNAMIC_BY_EXPLORER, Method.NCCL, 4, 0, 7.5))
    store.close()

    again = Store(path)
    (loaded,) = again.load_components()
    assert loaded.identity == c.identity and (loaded.state, loaded.step, loaded.awaited_version) == (State.REQUIRE_SYNC, 13, 11)
    assert [(r.version, r.method, r.path) for r in again.load_versions()] == [
        (10, Method.MEMORY, ""), (11, Method.CHECKPOINT, "/ckpt/11"),
    ]
    assert again.load_policy() == Policy(Style.DYNAMIC_BY_EXPLORER, Method.NCCL, 4, 0, 7.5)
    again.trim_versions(11)
    assert [r.version for r in again.load_versions()] == [11]
    assert Store(None).load_components() == [] and not Store(None).enabled
    nothing = Store(None)  # keeps nothing, refuses nothing
    nothing.save_policy(Policy(Style.FIXED, Method.MEMORY, 1, 0, 1.0))
    nothing.save_lineage(1, 2, [3])
    assert nothing.load_policy() is None and nothing.load_lineage() == (0, 0, set())


def write_checkpoint(directory: Path, version: int, *, manifest: bool = True, shards: int = 1) -> dict:
    state = small_state()
    state.pop("layer.0.empty")
    directory.mkdir(parents=True)
    names = list(state)
    weight_map = {}
    for i in range(shards):
        part = {n: state[n] for n in names[i::shards]}
        file = f"model-{i:05d}.safetensors"
        save_file(part, str(directory / file))
        weight_map.update({n: file for n in part})
    if shards > 1:
        (directory / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    if manifest:
        (directory / MANIFEST_FILE).write_bytes(build_manifest(state, version).SerializeToString())
    return state


def test_complete_checkpoints_pass(tmp_path: Path) -> None:
    state = write_checkpoint(tmp_path / "v3", 3, shards=2)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert verify_checkpoint(str(tmp_path / "v3"), 3, require_manifest=True, verify_digest=True) == nbytes
    write_checkpoint(tmp_path / "plain", 4, manifest=False)
    assert verify_checkpoint(str(tmp_path / "plain"), 4) > 0


def test_incomplete_checkpoints_fail(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="not a directory"):
        verify_checkpoint(str(tmp_path / "missing"), 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFound, match="no \\*.safetensors"):
        verify_checkpoint(str(tmp_path / "empty"), 1)

    write_checkpoint(tmp_path / "trunc", 1, shards=2)
    file = tmp_path / "trunc" / "model-00001.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(DataLoss, match="truncated"):
        verify_checkpoint(str(tmp_path / "trunc"), 1)

    write_checkpoint(tmp_path / "wrongver", 1)
    with pytest.raises(FailedPrecondition, match="describes version 1"):
        verify_checkpoint(str(tmp_path / "wrongver"), 2)

    write_checkpoint(tmp_path / "nomanifest", 1, manifest=False)
    with pytest.raises(FailedPrecondition, match="requires one"):
        verify_checkpoint(str(tmp_path / "nomanifest"), 1, require_manifest=True)

    state = write_checkpoint(tmp_path / "altered", 1)
    save_file({k: v + 1 if v.is_floating_point() else v for k, v in state.items()}, str(tmp_path / "altered" / "model-00000.safetensors"))
    verify_checkpoint(str(tmp_path / "altered"), 1)  # headers agree ...
    with pytest.raises(DataLoss, match="digest"):
        verify_checkpoint(str(tmp_path / "altered"), 1, verify_digest=True)  # ... the bytes do not

    write_checkpoint(tmp_path / "badindex", 1, shards=2)
    index = json.loads((tmp_path / "badindex" / INDEX_FILE).read_text())
    index["weight_map"]["ghost"] = "model-00009.safetensors"
    (tmp_path / "badindex" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(DataLoss, match="ghost"):
        verify_checkpoint(str(tmp_path / "badindex"), 1)


def test_manifest_must_list_the_files_tensors(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "c", 1)
    other = build_manifest({"x": torch.zeros(3)}, 1)
    (tmp_path / "c" / MANIFEST_FILE).write_bytes(other.SerializeToString())
    with pytest.raises(DataLoss, match="disagree"):
        verify_checkpoint(str(tmp_path / "c"), 1)
