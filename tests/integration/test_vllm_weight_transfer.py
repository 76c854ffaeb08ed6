"""MEMORY updates reach vLLM (the CPU build) through Flywheel's registered
weight-transfer engine, in vLLM's worker process, without a weight file:

* an update from the real synchronizer is read in place from its
  shared-memory segments by the worker, and the rollout then generates what
  transformers computes with the new weights (tokens and log-probs); no file
  appears in /dev/shm (the old staging directory) or the synchronizer's
  segment directory besides its segments, and nothing saves safetensors;
* a corrupt byte in a segment, or in the stream, rejects the update whole:
  DATA_LOSS, the old version serving bit for bit.
* vLLM's own API, without the rollout service, updates from an update info
  naming a synchronizer and a version, and refuses a corrupt one.

A rollout pulls from its own synchronizer (`synchronizer.address`): the
module's rollout is configured with the real synchronizer (a process of its
own, started first, its segments in a directory of the module's); the
corrupt stream comes from a rollout configured with a synchronizer test
double.

Spies are installed before vLLM forks its engine core, so they run in the
worker too, and write what they saw to a log the test reads.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file

from flywheel.common.v1 import common_pb2
from flywheel.models.tiny import build_tiny_model
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from flywheel.runtime.client import open_channel
from flywheel.launcher.processes import ServiceProcess, start_service
from tests.conftest import TEST_TOKEN
from tests.unit.rollout.fake_synchronizer import FakeSynchronizer, running_in_thread
from tests.unit.rollout.rollout_helpers import (
    ServerThread, need_engine, probe_of, reference_greedy, reference_logprobs, rollout_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT = [318, 268, 223, 20, 284, 223, 21, 33]
STEPS = 12
GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
SEGMENT_PREFIX = "flywheel-weights-"
# Other processes' IPC objects on this shared machine (vLLM's shm broadcast, multiprocessing
# semaphores, other synchronizers' segments): never weight files of this rollout.
OTHERS = ("psm_", "sem.", SEGMENT_PREFIX, f".draft-{SEGMENT_PREFIX}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm-transfer") / "model")


# Installed in every Python process started while the spy is on: vLLM spawns its engine core
# (a fresh interpreter), which imports this `sitecustomize` first. It records every load
# through Flywheel's weight-transfer engine, and every safetensors save.
SPY = """
import json, os

LOG = os.environ.get("FLYWHEEL_TEST_SPY_LOG")


def record(**event):
    with open(LOG, "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), **event}) + "\\n")


def install():
    import safetensors.torch

    from flywheel.transfer import segments
    from services.rollout.engine.vllm_transfer import FlywheelWeightTransferEngine

    receive = FlywheelWeightTransferEngine.receive_weights

    def spied_receive(self, update_info):
        kind = next(k for k in ("ticket", "synchronizer", "shared", "files") if getattr(update_info, k))
        receive(self, update_info)
        record(event="loaded", kind=kind, mapped=segments.SEGMENT_MAPS.paths)

    FlywheelWeightTransferEngine.receive_weights = spied_receive
    for name in ("save_file", "save"):
        original = getattr(safetensors.torch, name)

        def save(*args, _name=name, _original=original, **kwargs):
            record(event="safetensors." + _name)
            return _original(*args, **kwargs)

        setattr(safetensors.torch, name, save)


if LOG:
    install()
"""


@pytest.fixture(scope="module")
def spy_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The spy's log; the spy runs in this process (the rollout service) and in the processes it starts."""
    directory = tmp_path_factory.mktemp("spy")
    (directory / "sitecustomize.py").write_text(SPY)
    log = directory / "events.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv("FLYWHEEL_TEST_SPY_LOG", str(log))
    mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")])))
    import safetensors.torch

    from services.rollout.engine.vllm_transfer import FlywheelWeightTransferEngine

    for owner, name in ((FlywheelWeightTransferEngine, "receive_weights"), (safetensors.torch, "save_file"),
                        (safetensors.torch, "save")):
        mp.setattr(owner, name, getattr(owner, name))  # restored after the module
    exec(compile(SPY, str(directory / "sitecustomize.py"), "exec"), {})  # noqa: S102 - and in this process
    yield log
    mp.undo()


@pytest.fixture(scope="module")
def segment_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the module's synchronizer keeps its shared-memory segments."""
    return tmp_path_factory.mktemp("segments")


@pytest.fixture(scope="module")
def synchronizer(tmp_path_factory: pytest.TempPathFactory, segment_dir: Path,
                 spy_log: Path) -> Iterator[ServiceProcess]:
    """The product synchronizer, a process of its own (spied like any process started now)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_AUTH_TOKEN"] = TEST_TOKEN
    child = start_service("synchronizer", tmp_path_factory.mktemp("synchronizer-run"),
                          ["--shared-memory-dir", str(segment_dir)], env)
    try:
        child.wait_ready(120)
        yield child
    finally:
        child.stop()


def start_server(model_dir: Path, sync_address: str) -> ServerThread:
    """The vLLM rollout configured with the synchronizer at `sync_address`, on its base weights."""
    need_engine("vllm")
    srv = ServerThread(rollout_config(model_dir, "vllm", synchronizer={"address": sync_address})).start()
    srv.version = 0
    srv.state = load_file(str(model_dir / "model.safetensors"))
    return srv


@pytest.fixture(scope="module")
def server(model_dir: Path, spy_log: Path, synchronizer: ServiceProcess) -> Iterator[ServerThread]:
    srv = start_server(model_dir, synchronizer.grpc_address)
    yield srv
    srv.stop()


def events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def listing(directory: Path) -> set[str]:
    return set(os.listdir(directory))


async def greedy(rollout: pb_grpc.RolloutServiceStub) -> common_pb2.Sample:
    response = await rollout.Generate(pb.GenerateRequest(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT))],
                                                         sampling=GREEDY))
    return response.results[0].samples[0]


def scaled(model_dir: Path, factor: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(int(factor * 1000))
    base = load_file(str(model_dir / "model.safetensors"))
    # Noise as well as scale: a scaled model keeps many argmaxes, and log-probs must tell the weights apart.
    return {k: (v * factor + 0.02 * torch.randn_like(v)).contiguous() for k, v in base.items()}


async def push(address: str, state: dict[str, torch.Tensor], version: int, model_dir: Path) -> None:
    """Publishes `state` as a trainer does: with its probe (vLLM on CPU proves its linear layers by it)."""
    from flywheel.synchronizer.client import SynchronizerClient

    async with SynchronizerClient(address, token=TEST_TOKEN) as sync:
        await sync.push_weights(state, version, probe=probe_of(model_dir, state))


async def segment_of(address: str, version: int) -> Path:
    """The shared-memory segment the synchronizer holds `version` in: the file a reader on its
    host is told to map (segments are reused from version to version)."""
    from flywheel.synchronizer.v1 import synchronizer_pb2 as spb
    from flywheel.synchronizer.v1 import synchronizer_pb2_grpc as spb_grpc

    async with open_channel(address, token=TEST_TOKEN, default_timeout=60) as channel:
        call = spb_grpc.SynchronizerServiceStub(channel).PullWeights(
            spb.PullWeightsRequest(version=version, shared_memory=True))
        try:
            async for response in call:
                if response.HasField("segment"):
                    return Path(response.segment.path)
        finally:
            call.cancel()
    raise AssertionError(f"version {version} is not served from a shared-memory segment")


async def test_memory_update_from_segments_goes_through_the_registered_engine_and_writes_no_file(
    server: ServerThread, synchronizer: ServiceProcess, segment_dir: Path, spy_log: Path, model_dir: Path,
) -> None:
    new = scaled(model_dir, 1.2)
    await push(synchronizer.grpc_address, new, 1, model_dir)
    assert any(name.startswith(SEGMENT_PREFIX) for name in listing(segment_dir)), "the version must be in a segment"
    shm_before, tmp_before = listing(Path("/dev/shm")), listing(Path(tempfile.gettempdir()))
    logged = len(events(spy_log))
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        before = await greedy(rollout)
        response = await rollout.UpdateWeights(pb.UpdateWeightsRequest(version=1, memory=pb.MemorySource()),
                                               timeout=120)
        assert response.weight_version == 1 and response.bytes == sum(t.nbytes for t in new.values())
        after = await greedy(rollout)
        assert (await rollout.GetStatus(pb.GetStatusRequest())).weight_version == 1
    completion = list(after.completion_token_ids)
    assert completion == reference_greedy(model_dir, PROMPT, STEPS, new) != list(before.completion_token_ids)
    assert list(after.completion_logprobs) == pytest.approx(reference_logprobs(model_dir, PROMPT, completion, new),
                                                            abs=2e-3)
    assert (after.weight_version_start, after.weight_version_end) == (1, 1)

    new_events = events(spy_log)[logged:]
    loads = [e for e in new_events if e["event"] == "loaded"]
    assert len(loads) == 1 and loads[0]["kind"] == "ticket", new_events
    assert loads[0]["pid"] != os.getpid(), "loaded in vLLM's engine-core process, not the service's"
    assert any(Path(p).parent == segment_dir for p in loads[0]["mapped"]), "the worker read the segment in place"
    assert not [e for e in new_events if e["event"].startswith("safetensors.")], new_events
    new_shm = {n for n in listing(Path("/dev/shm")) - shm_before if not n.startswith(OTHERS)}
    assert not new_shm, f"files appeared in /dev/shm during the update: {new_shm}"
    new_tmp = {n for n in listing(Path(tempfile.gettempdir())) - tmp_before
               if n.endswith(".safetensors") or n.startswith("flywheel-rollout-")}
    assert not new_tmp, new_tmp
    assert all(n.startswith(SEGMENT_PREFIX) for n in listing(segment_dir)), listing(segment_dir)
    server.version, server.state = 1, new


async def _rejected(server: ServerThread, version: int) -> str:
    """A MEMORY update (from the server's synchronizer) that must fail DATA_LOSS and leave the
    served weights exactly as they were."""
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120, max_attempts=1) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        before = await greedy(rollout)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await rollout.UpdateWeights(pb.UpdateWeightsRequest(version=version, memory=pb.MemorySource()),
                                        timeout=120)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS, info.value.details()
        after = await greedy(rollout)
        status = await rollout.GetStatus(pb.GetStatusRequest())
    assert list(after.completion_token_ids) == list(before.completion_token_ids)
    assert list(after.completion_logprobs) == list(before.completion_logprobs)  # the same weights, bit for bit
    assert status.weight_version == server.version and not status.updating and not status.paused
    assert after.weight_version_start == server.version
    return info.value.details()


async def test_a_corrupt_byte_in_a_segment_rejects_the_update_whole(
    server: ServerThread, synchronizer: ServiceProcess, segment_dir: Path, spy_log: Path, model_dir: Path,
) -> None:
    version = server.version + 1
    await push(synchronizer.grpc_address, scaled(model_dir, 0.8), version, model_dir)
    segment = await segment_of(synchronizer.grpc_address, version)
    assert segment.parent == segment_dir and segment.name.startswith(SEGMENT_PREFIX)
    with open(segment, "r+b") as fh:  # the synchronizer maps it shared: it serves the flipped byte
        fh.seek(4096 + (segment.stat().st_size - 4096) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x01]))
    logged = len(events(spy_log))
    details = await _rejected(server, version)
    assert "checksum" in details
    assert not [e for e in events(spy_log)[logged:] if e["event"] == "loaded"], "nothing may be loaded"


async def test_a_corrupt_byte_in_the_stream_rejects_the_update_whole(spy_log: Path, model_dir: Path) -> None:
    """A rollout of its own, configured with a synchronizer test double that flips a byte of
    one chunk (the double serves no shared memory: the bytes travel in the stream)."""
    with running_in_thread() as sync:
        sync.model_dir = model_dir
        own = start_server(model_dir, sync.address)
        try:
            version = own.version + 1
            sync.add(version, scaled(model_dir, 1.4))
            sync.corrupt[version] = 7
            logged = len(events(spy_log))
            details = await _rejected(own, version)
        finally:
            own.stop()
    assert set(sync.pulls) == {version}  # from the rollout's own synchronizer
    assert "checksum" in details
    assert not [e for e in events(spy_log)[logged:] if e["event"] == "loaded"], "nothing may be loaded"


async def test_vllm_api_alone_updates_from_a_synchronizer_and_refuses_a_corrupt_version(model_dir: Path) -> None:
    """vLLM's own API, no rollout service: an update info naming a synchronizer and a version pulls,
    verifies and loads in one update_weights call; a corrupt chunk fails it, weights untouched."""
    need_engine("vllm")
    from vllm import SamplingParams
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from services.rollout.engine.vllm_engine import WORKER_EXTENSION
    from tests.unit.rollout.rollout_helpers import VLLM_ARGS

    async def generate() -> tuple[list[int], list[float]]:
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
        async for output in llm.generate({"prompt_token_ids": PROMPT}, params, f"r{os.urandom(4).hex()}"):
            final = output
        sample = final.outputs[0]
        return list(sample.token_ids), [entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs)]

    async def update(version: int) -> None:
        await llm.start_weight_update()
        await llm.update_weights(WeightTransferUpdateRequest(update_info={
            "synchronizer": sync.address, "version": version, "timeout_seconds": 60}))
        await llm.finish_weight_update(weight_version=str(version))
        await llm.reset_prefix_cache()

    new = scaled(model_dir, 0.6)
    sync = FakeSynchronizer()
    sync.add(1, new)
    sync.add(2, scaled(model_dir, 1.6))
    sync.corrupt[2] = 3
    await sync.start()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), worker_extension_cls=WORKER_EXTENSION, weight_transfer_config={"backend": "flywheel"},
        **VLLM_ARGS))
    try:
        await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        await update(1)
        tokens, logprobs = await generate()
        assert tokens == reference_greedy(model_dir, PROMPT, STEPS, new)
        assert logprobs == pytest.approx(reference_logprobs(model_dir, PROMPT, tokens, new), abs=2e-3)
        with pytest.raises(Exception, match=r"\[flywheel:DATA_LOSS\].*checksum"):
            await update(2)
        assert await generate() == (tokens, logprobs)  # version 1, bit for bit
    finally:
        llm.shutdown()
        await sync.stop()
