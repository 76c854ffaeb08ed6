"""Weight updates, all or nothing, on both engines: MEMORY (from a synchronizer
test double) and CHECKPOINT updates change greedy outputs and bump the
version; corrupt, misshapen and late updates leave the old weights serving
bit for bit; an update racing 50 requests tags each answer with one version.
A MEMORY update comes from the rollout's own synchronizer (`synchronizer.address`):
from the product synchronizer too, and one without is refused.

Tests run in file order on one server per engine; `Track` follows which
weights it serves. That server's synchronizer is one test double for the
module (its address is fixed when the server starts): each test adds the
versions it serves and finds no version or knob of an earlier test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from flywheel.common.v1 import common_pb2
from flywheel.models.tiny import build_tiny_model
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from flywheel.runtime.client import open_channel
from tests.conftest import TEST_TOKEN
from tests.unit.rollout.fake_synchronizer import FakeSynchronizer, running_in_thread
from tests.unit.rollout.rollout_helpers import (
    ServerThread,
    engine_args,
    need_engine,
    probe_of,
    write_checkpoint,
    reference_greedy,
    reference_logprobs,
    rollout_config,
)

ENGINES = ["transformers", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])]
PROMPT = [318, 268, 223, 20, 284, 223, 21, 33]
STEPS = 12
GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


@dataclass
class Track:
    model: Path
    version: int
    state: dict[str, torch.Tensor]
    greedy: dict[int, list[int]] = field(default_factory=dict)

    def scaled(self, factor: float) -> dict[str, torch.Tensor]:
        base = load_file(str(self.model / "model.safetensors"))
        return {k: v * factor for k, v in base.items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rollout-updates") / "model")


@pytest.fixture(scope="module")
def fake_sync(model_dir: Path) -> Iterator[FakeSynchronizer]:
    """The module's synchronizer test double, up before the servers configured with its address; each
    version it is given carries the probe a trainer would publish with it."""
    with running_in_thread() as fake:
        fake.model_dir = model_dir
        yield fake


@pytest.fixture(scope="module", params=ENGINES)
def server(request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           fake_sync: FakeSynchronizer):
    need_engine(request.param)
    args = engine_args(request.param)
    if request.param == "vllm":
        args["enable_prefix_caching"] = True  # explicit: the prefix-cache test below needs it on
    # Checkpoints are sent from each test's tmp_path: all of them lie under the session's base.
    updates = {"checkpoint_root": str(tmp_path_factory.getbasetemp())}
    link = {"address": fake_sync.address, "component_id": f"rollout-{request.param}"}
    config = rollout_config(model_dir, request.param, engine={"args": args}, updates=updates, synchronizer=link)
    srv = ServerThread(config).start()
    srv.track = Track(model_dir, 0, load_file(str(model_dir / "model.safetensors")))
    srv.engine_kind = request.param
    yield srv
    srv.stop()


@pytest.fixture
def sync(fake_sync: FakeSynchronizer) -> FakeSynchronizer:
    """The servers' synchronizer double, holding no version or knob of an earlier test."""
    fake_sync.reset()
    return fake_sync


async def greedy(rollout: pb_grpc.RolloutServiceStub) -> common_pb2.Sample:
    response = await rollout.Generate(pb.GenerateRequest(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT))], sampling=GREEDY))
    return response.results[0].samples[0]


async def update(rollout, version: int, **source) -> pb.UpdateWeightsResponse:
    return await rollout.UpdateWeights(pb.UpdateWeightsRequest(version=version, **source), timeout=120)


async def eventually(check, timeout: float = 30.0) -> None:
    """Waits until `check()` holds (what the rollout reports to its synchronizer arrives on its own)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.05)


async def test_memory_update_changes_outputs_and_bumps_the_version(server, sync: FakeSynchronizer) -> None:
    track: Track = server.track
    new = track.scaled(1.5)
    sync.add(1, new)
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        before = await greedy(rollout)
        assert list(before.completion_token_ids) == reference_greedy(track.model, PROMPT, STEPS)
        response = await update(rollout, 1, memory=pb.MemorySource(), method=common_pb2.SYNC_METHOD_MEMORY)
        assert response.weight_version == 1 and response.bytes == sum(t.nbytes for t in new.values())
        assert response.pause_seconds > 0
        after = await greedy(rollout)
        assert list(after.completion_token_ids) == reference_greedy(track.model, PROMPT, STEPS, new)
        assert list(after.completion_token_ids) != list(before.completion_token_ids)
        assert (after.weight_version_start, after.weight_version_end) == (1, 1)
        assert (await rollout.GetStatus(pb.GetStatusRequest())).weight_version == 1
    assert sync.pulls == [1]  # from the rollout's own synchronizer, the request naming none
    # ... which the rollout is registered with, and told of the version it serves now.
    me = server.config.synchronizer.component_id
    await eventually(lambda: me in sync.components and sync.components[me].weight_version == 1)
    track.version, track.state = 1, new


async def test_checkpoint_update_changes_outputs_and_bumps_the_version(server, tmp_path: Path) -> None:
    track: Track = server.track
    new = track.scaled(0.7)
    write_checkpoint(tmp_path, new, 2, track.model)
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        response = await update(rollout, 2, checkpoint=pb.CheckpointSource(path=str(tmp_path)))
        assert response.weight_version == 2
        after = await greedy(rollout)
        assert list(after.completion_token_ids) == reference_greedy(track.model, PROMPT, STEPS, new)
        assert after.weight_version_start == 2
    track.version, track.state = 2, new


async def _rejected(server, code: grpc.StatusCode, version: int, **source) -> str:
    """Runs a failing update; asserts the served weights stay bit for bit what they were."""
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120, max_attempts=1) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        before = await greedy(rollout)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await update(rollout, version, **source)
        assert info.value.code() == code, info.value.details()
        after = await greedy(rollout)
        assert list(after.completion_token_ids) == list(before.completion_token_ids)
        # Exactly equal log-probs: the same weights, not merely similar ones.
        assert list(after.completion_logprobs) == list(before.completion_logprobs)
        status = await rollout.GetStatus(pb.GetStatusRequest())
        assert status.weight_version == server.track.version and not status.updating and not status.paused
        assert after.weight_version_start == server.track.version
        return info.value.details()


async def test_corrupt_chunk_is_rejected_and_old_weights_keep_serving(server, sync: FakeSynchronizer) -> None:
    sync.add(3, server.track.scaled(2.0))
    sync.corrupt[3] = 5
    details = await _rejected(server, grpc.StatusCode.DATA_LOSS, 3, memory=pb.MemorySource())
    assert "checksum" in details
    # The failure is reported to the rollout's synchronizer, the old version still served.
    reports = lambda: [c for c in sync.state_changes if c.id == server.config.synchronizer.component_id]  # noqa: E731
    await eventually(lambda: any("checksum" in c.reason for c in reports()))
    assert [c.weight_version for c in reports()] == [server.track.version]


async def test_wrong_shape_is_rejected_and_old_weights_keep_serving(server, sync: FakeSynchronizer,
                                                                     tmp_path: Path) -> None:
    bad = server.track.scaled(2.0)
    bad["model.layers.1.mlp.down_proj.weight"] = bad["model.layers.1.mlp.down_proj.weight"][:, :-1].contiguous()
    sync.add(3, bad)
    details = await _rejected(server, grpc.StatusCode.INVALID_ARGUMENT, 3, memory=pb.MemorySource())
    assert "down_proj" in details and "shape" in details
    save_file(bad, str(tmp_path / "model.safetensors"))
    await _rejected(server, grpc.StatusCode.INVALID_ARGUMENT, 3, checkpoint=pb.CheckpointSource(path=str(tmp_path)))


async def test_stalled_transfer_times_out_and_old_weights_keep_serving(server, sync: FakeSynchronizer) -> None:
    sync.add(3, server.track.scaled(2.0))
    sync.stall[3] = 30
    await _rejected(server, grpc.StatusCode.DEADLINE_EXCEEDED, 3, memory=pb.MemorySource(), timeout_seconds=1.0)


async def test_update_racing_50_requests_tags_each_answer_with_one_version(server, sync: FakeSynchronizer) -> None:
    track: Track = server.track
    new = track.scaled(1.25)
    expected = {track.version: reference_greedy(track.model, PROMPT, STEPS, track.state),
                3: reference_greedy(track.model, PROMPT, STEPS, new)}
    assert expected[track.version] != expected[3]
    sync.add(3, new)
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        requests = [asyncio.ensure_future(greedy(rollout)) for _ in range(25)]
        while (await rollout.GetStatus(pb.GetStatusRequest())).running_requests == 0:
            await asyncio.sleep(0.005)
        # Pause mode "wait" named: the rollout's default (keep) lets a request span both versions.
        updating = asyncio.ensure_future(update(rollout, 3, memory=pb.MemorySource(),
                                                pause_mode=common_pb2.PAUSE_MODE_WAIT))
        # Requests keep arriving for as long as the update takes (the engine may stage the new
        # version for a while before it pauses; on a loaded machine 25 requests 5 ms apart all
        # arrived before the pause), and a few after it.
        for arrived in range(1000):
            if arrived >= 25 and updating.done():
                break
            requests.append(asyncio.ensure_future(greedy(rollout)))
            await asyncio.sleep(0.005 if arrived < 25 else 0.1)
        requests += [asyncio.ensure_future(greedy(rollout)) for _ in range(3)]
        response = await updating
        samples = await asyncio.gather(*requests)
    assert response.weight_version == 3
    seen = set()
    for sample in samples:
        assert sample.weight_version_start == sample.weight_version_end
        assert list(sample.completion_token_ids) == expected[sample.weight_version_start]
        seen.add(sample.weight_version_start)
    # Requests in flight when the update paused generation drained on the old weights
    # (pause mode "wait"); those that arrived after the pause ran on the new ones.
    assert seen == set(expected)
    track.version, track.state = 3, new


async def running(rollout: pb_grpc.RolloutServiceStub, request_id: str,
                  sampling: common_pb2.SamplingParams) -> asyncio.Future:
    """A generation of PROMPT, once the rollout has it running."""
    generation = asyncio.ensure_future(rollout.Generate(pb.GenerateRequest(
        prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT), request_id=request_id)], sampling=sampling)))
    while (await rollout.GetStatus(pb.GetStatusRequest())).running_requests == 0:
        await asyncio.sleep(0.005)
    return generation


async def test_keep_mode_update_continues_requests_across_versions(server, tmp_path: Path) -> None:
    track: Track = server.track
    new = track.scaled(0.9)
    write_checkpoint(tmp_path, new, 4, track.model)
    long = common_pb2.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        generation = await running(rollout, "long", long)
        response = await update(rollout, 4, checkpoint=pb.CheckpointSource(path=str(tmp_path)), pause_mode=common_pb2.PAUSE_MODE_KEEP)
        assert response.weight_version == 4 and not response.aborted_request_ids
        sample = (await generation).results[0].samples[0]
    assert sample.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(sample.completion_token_ids) == 200
    assert (sample.weight_version_start, sample.weight_version_end) == (track.version, 4)
    track.version, track.state = 4, new


async def test_memory_update_from_the_real_synchronizer(server, run_service) -> None:
    """A rollout of the same engine configured with the product synchronizer (a process of its
    own; the module's server has the double) pulls a version pushed there, and the synchronizer
    then lists the rollout on it. The module's server and its `Track` are left alone."""
    from flywheel.synchronizer.client import SynchronizerClient
    from flywheel.synchronizer.types import Role

    track: Track = server.track
    new = track.scaled(1.1)
    synchronizer = run_service("synchronizer")
    config = rollout_config(track.model, server.engine_kind, engine={"args": dict(server.config.engine.args)},
                            synchronizer={"address": synchronizer.grpc_address})
    own = ServerThread(config).start()  # registered with the synchronizer once it serves
    try:
        async with SynchronizerClient(synchronizer.grpc_address, token=TEST_TOKEN) as sync:
            await sync.push_weights(new, 5, probe=probe_of(track.model, new))  # after the rollout started
            async with open_channel(own.address, token=TEST_TOKEN, default_timeout=120) as channel:
                rollout = pb_grpc.RolloutServiceStub(channel)
                assert (await rollout.GetStatus(pb.GetStatusRequest())).weight_version == 0
                response = await update(rollout, 5, memory=pb.MemorySource())
                assert response.weight_version == 5
                after = await greedy(rollout)
            deadline = asyncio.get_running_loop().time() + 30
            while True:  # the rollout reports the version it serves to its synchronizer
                rollouts = [c for c in (await sync.status()).components if c.identity.role == Role.ROLLOUT]
                if [c.weight_version for c in rollouts] == [5] or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert [c.weight_version for c in rollouts] == [5], rollouts
    finally:
        own.stop()
    assert list(after.completion_token_ids) == reference_greedy(track.model, PROMPT, STEPS, new)
    assert (after.weight_version_start, after.weight_version_end) == (5, 5)


async def test_memory_update_without_a_synchronizer_is_refused_and_old_weights_keep_serving(model_dir: Path) -> None:
    """MEMORY and NCCL updates come from the rollout's own synchronizer, which a request cannot
    name: a rollout with no `synchronizer.address` refuses them (FAILED_PRECONDITION, naming the
    setting) and serves its weights unchanged. The refusal is the service's, before any engine
    work: the transformers engine shows it."""
    standalone = ServerThread(rollout_config(model_dir, "transformers")).start()
    standalone.track = Track(model_dir, 0, load_file(str(model_dir / "model.safetensors")))
    try:
        for source in ({"memory": pb.MemorySource(), "method": common_pb2.SYNC_METHOD_MEMORY},
                       {"nccl": pb.NcclSource(group_id="g", rank=1)}):
            details = await _rejected(standalone, grpc.StatusCode.FAILED_PRECONDITION, 1, **source)
            assert "synchronizer.address" in details, details
    finally:
        standalone.stop()


async def test_a_keep_update_with_a_seeded_request_in_flight_leaves_the_engine_serving(server, tmp_path: Path) -> None:
    """vLLM on CPU cannot preempt a request that carries its own seed across a weight swap (its engine
    core died on it): such a request ends aborted, to be retried, and the replica serves on. The
    transformers engine freezes it like any other."""
    track: Track = server.track
    new = track.scaled(1.05)
    version = track.version + 1
    write_checkpoint(tmp_path, new, version, track.model)
    seeded = common_pb2.SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=7)
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        generation = await running(rollout, "seeded", seeded)
        await update(rollout, version, checkpoint=pb.CheckpointSource(path=str(tmp_path)),
                     pause_mode=common_pb2.PAUSE_MODE_KEEP)
        sample = (await generation).results[0].samples[0]
        after = await greedy(rollout)  # the engine still serves
    expected = common_pb2.FINISH_REASON_ABORT if server.engine_kind == "vllm" else common_pb2.FINISH_REASON_LENGTH
    assert sample.finish_reason == expected
    assert list(after.completion_token_ids) == reference_greedy(track.model, PROMPT, STEPS, new)
    track.version, track.state = version, new


async def test_an_update_of_the_tied_embedding_alone_reaches_the_output_head(server, tmp_path: Path) -> None:
    """The tiny models (like SmolLM2) tie their LM head to the token embedding. An update that changes
    only that matrix must move the served log-probs exactly as transformers' do: vLLM on CPU keeps a
    packed copy of the head that its reload did not refresh (uniformly scaled weights could not show
    it: a scaled head keeps every argmax)."""
    track: Track = server.track
    name = next(k for k in track.state if "embed_tokens" in k)
    torch.manual_seed(1)
    new = dict(track.state)
    new[name] = track.state[name] + 0.05 * torch.randn_like(track.state[name])
    version = track.version + 1
    write_checkpoint(tmp_path, new, version, track.model)
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        await update(rollout, version, checkpoint=pb.CheckpointSource(path=str(tmp_path)))
        sample = await greedy(rollout)
    served = list(sample.completion_logprobs)
    expected = reference_logprobs(track.model, PROMPT, list(sample.completion_token_ids), new)
    before = reference_logprobs(track.model, PROMPT, list(sample.completion_token_ids), track.state)
    assert max(abs(a - b) for a, b in zip(expected, before)) > 0.05, "the change must be visible to matter"
    assert served == pytest.approx(expected, abs=2e-3)
    track.version, track.state = version, new


async def test_no_prefix_cached_under_old_weights_is_reused_after_an_update(server, tmp_path: Path) -> None:
    """A prompt long enough to fill a KV block (vLLM on CPU caches 128-token blocks) is answered
    before an update, then again after it: the second answer must be what the new weights give from
    scratch. Reusing the cached prefix would condition it on keys and values of the old weights.
    KEEP mode: the other modes' pause empties the cache by itself, so only the swap's own reset
    stands between KEEP and a stale prefix."""
    track: Track = server.track
    prompt = [(17 * i) % 500 + 4 for i in range(236)]
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    request = pb.GenerateRequest(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=prompt))], sampling=sampling)
    new = track.scaled(1.3)
    version = track.version + 1
    write_checkpoint(tmp_path, new, version, track.model)
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        for _ in range(2):  # the second one is served from the prefix cache, where there is one
            await rollout.Generate(request)
        await update(rollout, version, checkpoint=pb.CheckpointSource(path=str(tmp_path)),
                     pause_mode=common_pb2.PAUSE_MODE_KEEP)
        sample = (await rollout.Generate(request)).results[0].samples[0]
    completion = list(sample.completion_token_ids)
    expected = reference_logprobs(track.model, prompt, completion, new)
    stale = reference_logprobs(track.model, prompt, completion, track.state)
    assert max(abs(a - b) for a, b in zip(expected, stale)) > 0.05, "the change must be visible to matter"
    assert list(sample.completion_logprobs) == pytest.approx(expected, abs=2e-3)
    track.version, track.state = version, new


async def test_update_must_move_forward(server) -> None:
    async with open_channel(server.address, token=TEST_TOKEN, max_attempts=1) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await update(rollout, server.track.version, checkpoint=pb.CheckpointSource(path="nonexistent"))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await update(rollout, 99, checkpoint=pb.CheckpointSource(path="/x"), method=common_pb2.SYNC_METHOD_MEMORY)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_start_over_names_no_version_and_no_source(server) -> None:
    """Back to the base model is version 0 from engine.model_path: anything else it is sent is refused, and
    the served weights stay (tests/integration/test_tinker_gateway.py takes a replica back to the base)."""
    for version, source in ((5, {}), (0, {"checkpoint": pb.CheckpointSource(path="elsewhere")})):
        details = await _rejected(server, grpc.StatusCode.INVALID_ARGUMENT, version, start_over=True, **source)
        assert "give no version and no source" in details


async def test_checkpoint_paths_outside_the_root_are_refused_and_nothing_changes(server, tmp_path: Path) -> None:
    outside = tmp_path.parent.parent.parent  # above the session's base temp: outside updates.checkpoint_root
    async with open_channel(server.address, token=TEST_TOKEN, max_attempts=1) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        before = await greedy(rollout)
        for path, code in [(str(outside), grpc.StatusCode.PERMISSION_DENIED),
                           (f"{tmp_path}/../../../..", grpc.StatusCode.PERMISSION_DENIED),
                           ("ck\0pt", grpc.StatusCode.INVALID_ARGUMENT), ("n" * 300, grpc.StatusCode.INVALID_ARGUMENT)]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await update(rollout, server.track.version + 1, checkpoint=pb.CheckpointSource(path=path))
            assert info.value.code() == code, (path, info.value.details())
            assert "checkpoint.path" in info.value.details()
        after = await greedy(rollout)
    assert (after.weight_version_end, list(after.completion_token_ids)) == (
        before.weight_version_end, list(before.completion_token_ids))
