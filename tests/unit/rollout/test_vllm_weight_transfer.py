"""Flywheel's vLLM weight-transfer engine without a vLLM engine around it:
registered once however often it is imported, stages a MEMORY version in the
background and verifies it whole before anything is loaded, and carries the
status code of a refusal through vLLM's text-only RPC errors."""

from __future__ import annotations

import asyncio
import importlib
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from flywheel.testing.net import free_port
from tests.unit.rollout.fake_synchronizer import FakeSynchronizer

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402

from services.rollout.engine import vllm_transfer  # noqa: E402
from services.rollout.engine.vllm_transfer import BACKEND, FlywheelWeightTransferEngine, register  # noqa: E402

STATE = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}


def test_registering_twice_changes_nothing_and_a_foreign_engine_under_the_name_is_refused() -> None:
    register()
    register()
    importlib.reload(importlib.import_module("services.rollout.engine.vllm_worker"))  # registers on import
    assert WeightTransferEngineFactory._registry[BACKEND]() is FlywheelWeightTransferEngine
    saved = WeightTransferEngineFactory._registry.pop(BACKEND)
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, type("Other", (FlywheelWeightTransferEngine,), {}))
        with pytest.raises(RuntimeError, match="another engine"):
            register()
    finally:
        WeightTransferEngineFactory._registry[BACKEND] = saved


class Recorder(FlywheelWeightTransferEngine):
    """The engine with vLLM's reload replaced by a record of what it was given."""

    def __init__(self, model_dir: Path) -> None:
        model_config = SimpleNamespace(model=str(model_dir), dtype=torch.float32)
        config = SimpleNamespace(parallel_config=None, model_config=model_config)
        super().__init__(SimpleNamespace(backend=BACKEND), config, torch.device("cpu"), torch.nn.Module())
        self.loads: list[dict[str, torch.Tensor]] = []

        self.staged_at: list[int] = []
        self.keep = False  # True: the model keeps the loaded tensors themselves (no copy)

    def _load(self, weights: Any, faults: Any = None) -> None:
        weights = dict(weights)
        self.staged_at.append(next(iter(weights.values())).untyped_storage().data_ptr())
        self.loads.append({name: tensor.clone() for name, tensor in weights.items()})
        if self.keep:
            for i, tensor in enumerate(weights.values()):
                self.model.register_parameter(f"p{i}", torch.nn.Parameter(tensor, requires_grad=False))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save_file(STATE, str(tmp_path / "model.safetensors"))
    return tmp_path


async def wait_staged(engine: FlywheelWeightTransferEngine, ticket: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while (state := engine.staged(ticket))["state"] == "pending":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)  # the synchronizer double serves on this loop
    return state


async def test_a_staged_version_is_loaded_whole_and_a_corrupt_one_never(model_dir: Path) -> None:
    new = {name: t * 2 for name, t in STATE.items()}
    sync = FakeSynchronizer()
    sync.add(1, new, chunk_bytes=32)
    sync.add(2, new, chunk_bytes=32)
    sync.corrupt[2] = 1
    await sync.start()
    engine = Recorder(model_dir)
    try:
        pull = {"synchronizer": sync.address, "timeout_seconds": 30, "tls": {}}
        engine.stage("a", {**pull, "version": 1})
        engine.stage("b", {**pull, "version": 2})
        assert await wait_staged(engine, "a") == {"state": "ready", "bytes": sum(t.nbytes for t in new.values())}
        failed = await wait_staged(engine, "b")
        assert failed["state"] == "failed" and failed["code"] == "DATA_LOSS" and "checksum" in failed["message"]
        assert engine.loads == []  # staging never loads
        await asyncio.to_thread(engine.update_weights, {"ticket": "a"})
        assert len(engine.loads) == 1
        assert all(torch.equal(engine.loads[0][name], new[name]) for name in new)
        # A refusal in update_weights comes back as text through vLLM: the code travels in it.
        with pytest.raises(RuntimeError) as info:
            await asyncio.to_thread(engine.update_weights, {**pull, "version": 2})
        assert vllm_transfer.decode_error(f"Call to update_weights failed: {info.value}")[0] == "DATA_LOSS"
        with pytest.raises(RuntimeError, match="NOT_FOUND"):
            await asyncio.to_thread(engine.update_weights, {"ticket": "a"})  # loaded once, then forgotten
        assert len(engine.loads) == 1
    finally:
        engine.shutdown()
        await sync.stop()


async def test_a_version_the_model_cannot_serve_is_refused_before_its_chunks(model_dir: Path) -> None:
    bad = dict(STATE, **{"model.norm.weight": torch.ones(5)})
    sync = FakeSynchronizer()
    sync.add(1, bad)
    await sync.start()
    engine = Recorder(model_dir)
    try:
        engine.stage("a", {"synchronizer": sync.address, "version": 1, "timeout_seconds": 30, "tls": {}})
        failed = await wait_staged(engine, "a")
        assert failed["code"] == "INVALID_ARGUMENT" and "model.norm.weight" in failed["message"]
        assert engine.loads == []
    finally:
        engine.shutdown()
        await sync.stop()


async def test_a_stalled_pull_ends_at_its_deadline(model_dir: Path) -> None:
    sync = FakeSynchronizer()
    sync.add(1, STATE)
    sync.stall[1] = 30
    await sync.start()
    engine = Recorder(model_dir)
    try:
        started = time.monotonic()
        engine.stage("a", {"synchronizer": sync.address, "version": 1, "timeout_seconds": 1.0, "tls": {}})
        failed = await wait_staged(engine, "a")
        assert failed["code"] == "DEADLINE_EXCEEDED" and time.monotonic() - started < 10
        assert engine.loads == []
    finally:
        engine.shutdown()
        await sync.stop()


@pytest.mark.parametrize("keep", [False, True])
async def test_staging_tensors_are_reused_only_when_the_model_copied_them(model_dir: Path, keep: bool) -> None:
    versions = {v: {name: t * v for name, t in STATE.items()} for v in (1, 2, 3)}
    sync = FakeSynchronizer()
    for version, state in versions.items():
        sync.add(version, state)
    await sync.start()
    engine = Recorder(model_dir)
    engine.keep = keep
    try:
        for version, state in versions.items():
            engine.stage(str(version), {"synchronizer": sync.address, "version": version, "timeout_seconds": 30,
                                        "tls": {}, "reuse_staging": True})
            assert (await wait_staged(engine, str(version)))["state"] == "ready"
            await asyncio.to_thread(engine.update_weights, {"ticket": str(version)})
            assert all(torch.equal(engine.loads[-1][name], state[name]) for name in state)
    finally:
        engine.shutdown()
        await sync.stop()
    reused = [engine.staged_at[i] == engine.staged_at[i + 1] for i in range(2)]
    # Kept by the model: staging the next version into them would change the served weights under it.
    assert reused == ([False, False] if keep else [True, True])


def test_update_info_names_exactly_one_source() -> None:
    from services.rollout.engine.vllm_transfer import FlywheelUpdateInfo

    for bad in ({}, {"ticket": "a", "files": []}, {"synchronizer": "x:1"}):
        with pytest.raises(ValueError):
            FlywheelUpdateInfo(**bad)


async def test_an_abandoned_swap_still_ends_with_the_version_of_the_loaded_weights(tmp_path: Path) -> None:
    """Cancelling the swap while the worker loads must not leave new weights under the old version."""
    from services.rollout.engine.base import MemorySource, StagedWeights
    from services.rollout.engine.vllm_engine import VllmEngine

    calls: list[str] = []
    loading = asyncio.Event()

    class StubLLM:
        async def start_weight_update(self) -> None:
            calls.append("start")

        async def update_weights(self, request: Any) -> None:
            calls.append(f"update {request.update_info}")
            loading.set()
            await asyncio.sleep(0.3)

        async def finish_weight_update(self, weight_version: str | None = None) -> None:
            calls.append("finish")

        async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
            calls.append("reset")

        async def update_weight_version(self, version: str) -> None:
            calls.append(f"version {version}")

    engine = VllmEngine(tmp_path, {}, codec=None, initial_version=1)  # type: ignore[arg-type]
    engine._llm = StubLLM()
    source = MemorySource("sync:1", 2, None, 10.0, 1 << 20, ticket="t")
    swap = asyncio.ensure_future(engine.swap_weights(StagedWeights(version=2, source=source)))
    await loading.wait()
    swap.cancel()
    with pytest.raises(asyncio.CancelledError):
        await swap
    assert calls == ["start", "update {'ticket': 't'}", "finish", "reset", "version 2"]
    assert engine.version == 2


# -- receiving in the synchronizer's transfer group (gloo on CPU) -----------------

def group_spec(rank: int, port: int, *, backend: str = "gloo", seconds: float = 30.0) -> dict[str, Any]:
    return {"group_id": f"v1-test{port}", "rendezvous_address": f"127.0.0.1:{port}", "world_size": 2, "rank": rank,
            "backend": backend, "deadline": time.time() + seconds, "version": 1}


def trainer_sends(spec: dict[str, Any], state: dict[str, torch.Tensor]) -> asyncio.Future:
    """Rank 0 of the group: the trainer's broadcast, in a thread of this process."""
    from flywheel.transfer.broadcast import GroupSpec, send

    return asyncio.ensure_future(asyncio.to_thread(send, GroupSpec(**spec), state, bucket_bytes=64))


async def test_a_version_received_in_the_group_is_held_until_loaded_by_its_ticket(model_dir: Path) -> None:
    new = {name: t * 3 for name, t in STATE.items()}
    port = free_port()
    engine = Recorder(model_dir)
    try:
        engine.stage("g", {"group": group_spec(1, port)})
        sent = trainer_sends(group_spec(0, port), new)
        assert await wait_staged(engine, "g") == {"state": "ready", "bytes": sum(t.nbytes for t in new.values())}
        await asyncio.wait_for(sent, 30)
        assert engine.loads == []  # received, not loaded: the synchronizer's verdict comes first
        await asyncio.to_thread(engine.update_weights, {"ticket": "g"})
        assert [set(load) for load in engine.loads] == [set(new)]
        assert all(torch.equal(engine.loads[0][name], new[name]) for name in new)
        with pytest.raises(ValueError, match="staged first"):
            engine.receive_weights(vllm_transfer.FlywheelUpdateInfo(group=group_spec(1, port)))
    finally:
        engine.shutdown()


async def test_a_corrupt_bucket_or_a_misshapen_broadcast_is_refused_and_nothing_loaded(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from flywheel.transfer import broadcast

    real = broadcast.xxhash.xxh3_64_intdigest

    def flipped_on_receipt(data: Any) -> int:
        # The bytes the worker's receive thread hashes differ from what the trainer hashed: a corrupt bucket.
        return real(data) ^ (1 if threading.current_thread().name.startswith("flywheel-receive") else 0)

    monkeypatch.setattr(broadcast.xxhash, "xxh3_64_intdigest", flipped_on_receipt)
    engine = Recorder(model_dir)
    try:
        port = free_port()
        engine.stage("corrupt", {"group": group_spec(1, port)})
        sent = trainer_sends(group_spec(0, port), STATE)
        failed = await wait_staged(engine, "corrupt")
        assert failed["state"] == "failed" and failed["code"] == "DATA_LOSS", failed
        with pytest.raises(Exception):  # noqa: B017 - the trainer learns it through the store's abort key
            await asyncio.wait_for(sent, 30)
        monkeypatch.setattr(broadcast.xxhash, "xxh3_64_intdigest", real)
        port = free_port()
        engine.stage("misshapen", {"group": group_spec(1, port)})
        sent = trainer_sends(group_spec(0, port), dict(STATE, **{"model.norm.weight": torch.ones(5)}))
        failed = await wait_staged(engine, "misshapen")
        assert failed["code"] == "INVALID_ARGUMENT" and "model.norm.weight" in failed["message"]
        with pytest.raises(Exception):  # noqa: B017
            await asyncio.wait_for(sent, 30)
        assert engine.loads == []
    finally:
        engine.shutdown()


async def test_dropping_a_receive_stops_it_at_once_and_nccl_without_cuda_is_refused(model_dir: Path) -> None:
    engine = Recorder(model_dir)
    try:
        engine.stage("waiting", {"group": group_spec(1, free_port(), seconds=60)})  # no trainer ever comes
        future, _ = engine._staged["waiting"]
        await asyncio.sleep(0.5)
        started = time.monotonic()
        engine.drop("waiting")
        with pytest.raises(Exception, match="aborted"):
            await asyncio.wait_for(asyncio.wrap_future(future), 15)
        assert time.monotonic() - started < 10, "a dropped receive waited for the group's deadline"
        assert engine.staged("waiting")["code"] == "NOT_FOUND"
        if not torch.cuda.is_available():
            from flywheel.errors import FailedPrecondition

            with pytest.raises(FailedPrecondition, match="gloo"):
                engine.stage("nccl", {"group": group_spec(1, free_port(), backend="nccl")})
        assert engine.loads == []
    finally:
        engine.shutdown()
