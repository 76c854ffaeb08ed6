"""The gRPC adapters against in-process servers: protobuf <-> domain, errors,
and a whole pipeline run over real gRPC (servers backed by simulated engines)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from flywheel.codec.dtypes import tensor_from_proto
from flywheel.common.types import finish_reason_to_pb
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import FailedPrecondition, InvalidArgument, Unavailable
from flywheel.rollout.v1 import rollout_pb2 as rpb
from flywheel.rollout.v1 import rollout_pb2_grpc as rpb_grpc
from flywheel.runtime.interceptors import ErrorInterceptor
from flywheel.synchronizer.v1 import synchronizer_pb2 as spb
from flywheel.synchronizer.v1 import synchronizer_pb2_grpc as spb_grpc
from flywheel.trainer.v1 import trainer_pb2 as tpb
from flywheel.trainer.v1 import trainer_pb2_grpc as tpb_grpc
from services.controller.adapters import GrpcHealthProbe, GrpcRolloutEngine, GrpcSynchronizer, GrpcTrainer, connect
from services.controller.assemble import build_pipeline
from services.controller.batching import build_train_batch
from services.controller.domain import FinishReason, NcclGroup, PromptInput, SamplingSpec, WeightSource
from services.controller.loop import run
from services.controller.simulated import SimulatedRolloutEngine, SimulatedTrainer, constant
from tests.unit.controller.controller_helpers import config, task, trajectory



class FakeTrainer(tpb_grpc.TrainerServiceServicer):
    """A trainer service whose model is a SimulatedTrainer."""

    def __init__(self) -> None:
        self.sim = SimulatedTrainer(train_time=constant(0.002))
        self.requests: list = []

    async def GetInfo(self, request, context):
        return tpb.GetInfoResponse(step=self.sim.step, weight_version=self.sim.version, ready=True)

    async def TrainStep(self, request, context):
        self.requests.append(request)
        tensors = {f.name: tensor_from_proto(v) for f, v in request.batch.ListFields()}
        if tensors["loss_mask"].sum() == 0:
            raise InvalidArgument("batch.loss_mask: selects no tokens")
        batch = SimpleNamespace(tensors=tensors, tokens=int(tensors["attention_mask"].sum()))
        expected = request.expected_step if request.HasField("expected_step") else None
        result = await self.sim.train_step(batch, None, micro_batch_size=request.micro_batch_size, expected_step=expected)
        metrics = [cpb.Metric(name=k, value=v) for k, v in result.metrics.items()]
        return tpb.TrainStepResponse(step=result.step, weight_version=result.version, tokens=result.tokens, metrics=metrics)

    async def SaveCheckpoint(self, request, context):
        return tpb.SaveCheckpointResponse(path=await self.sim.save_checkpoint(request.client_state), step=self.sim.step)

    async def LoadCheckpoint(self, request, context):
        restored = await self.sim.load_checkpoint(request.path or None)
        if restored is None:
            return tpb.LoadCheckpointResponse()
        return tpb.LoadCheckpointResponse(path=restored.path, step=restored.step, weight_version=restored.version,
                                          client_state=restored.client_state)

    async def ExportWeights(self, request, context):
        path = f"{request.checkpoint.directory or '/ckpt'}/v{self.sim.version}" if request.HasField("checkpoint") else ""
        return tpb.ExportWeightsResponse(weight_version=self.sim.version, path=path)


class FakeRollout(rpb_grpc.RolloutServiceServicer):
    def __init__(self, name: str) -> None:
        self.sim = SimulatedRolloutEngine(name=name, gen_time=constant(0.003), rng=random.Random(1))
        self.updates: list = []

    async def Generate(self, request, context):
        prompts = []
        for p in request.prompts:
            kind = p.WhichOneof("content")
            if kind == "token_ids":
                prompts.append(PromptInput(p.request_id, token_ids=list(p.token_ids.ids)))
            elif kind == "messages":
                prompts.append(PromptInput(p.request_id, messages=[{"role": m.role, "content": m.content} for m in p.messages.messages]))
            else:
                prompts.append(PromptInput(p.request_id, text=p.text))
        s = request.sampling
        results = await self.sim.generate(prompts, SamplingSpec(n=s.n or 1, max_tokens=s.max_tokens))
        return rpb.GenerateResponse(results=[
            rpb.PromptResult(request_id=p.request_id, samples=[
                cpb.Sample(prompt_token_ids=g.prompt_token_ids, completion_token_ids=g.completion_token_ids,
                           completion_logprobs=g.completion_logprobs, finish_reason=finish_reason_to_pb(g.finish_reason),
                           weight_version_start=g.version_start, weight_version_end=g.version_end, text=g.text, index=i)
                for i, g in enumerate(gens)])
            for p, gens in zip(prompts, results)])

    async def Tokenize(self, request, context):
        return rpb.TokenizeResponse(token_ids=[1, 2, 3] if request.HasField("messages") else [7] * len(request.text.split()))

    async def GetStatus(self, request, context):
        return rpb.GetStatusResponse(weight_version=self.sim.version)

    async def UpdateWeights(self, request, context):
        self.updates.append(request)
        source = WeightSource("checkpoint", path=request.checkpoint.path)
        pause = {cpb.PAUSE_MODE_KEEP: "keep", cpb.PAUSE_MODE_WAIT: "wait", cpb.PAUSE_MODE_ABORT: "abort"}[request.pause_mode]
        return rpb.UpdateWeightsResponse(weight_version=await self.sim.update_weights(request.version, source, pause_mode=pause))


class FakeSynchronizer(spb_grpc.SynchronizerServiceServicer):
    def __init__(self, rollout_addresses: list[str]) -> None:
        self.addresses = rollout_addresses
        self.registered: list = []
        self.policy = spb.ConfigurePolicyRequest(sync_interval=1)

    async def ConfigurePolicy(self, request, context):
        self.policy = request
        return spb.ConfigurePolicyResponse()

    async def NeedSync(self, request, context):
        if request.id != "trainer-0":
            raise FailedPrecondition(f"unknown component {request.id}")
        return spb.NeedSyncResponse(need_sync=request.step % self.policy.sync_interval == 0, version=request.step)

    async def RegisterCheckpoint(self, request, context):
        self.registered.append((request.version, request.path))
        return spb.RegisterCheckpointResponse(version=request.version)

    async def Status(self, request, context):
        return spb.StatusResponse(latest_version=7, components=[
            cpb.ComponentStatus(
                identity=cpb.ComponentIdentity(id=f"rollout-{i}", address=a, role=cpb.COMPONENT_ROLE_ROLLOUT),
                state=cpb.COMPONENT_STATE_RUNNING, weight_version=5,
            )
            for i, a in enumerate(self.addresses)
        ])

    async def AllocateGroup(self, request, context):
        members = [spb.GroupMember(id="trainer-0", rank=0)] + [spb.GroupMember(id=r, rank=i + 1) for i, r in enumerate(request.rollout_ids)]
        return spb.AllocateGroupResponse(group_id="g1", rendezvous_address="10.0.0.1:29500", world_size=len(members),
                                         backend="gloo", members=members, version=request.version)


@pytest.fixture
async def cluster():
    servers, fakes = [], {}

    async def serve(register, name, fake) -> str:
        server = grpc.aio.server(interceptors=[ErrorInterceptor(name)])
        register(fake, server)
        h = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(h, server)
        await h.set("", health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        fakes[name] = fake
        return f"127.0.0.1:{port}"

    addresses = {
        "trainer": await serve(tpb_grpc.add_TrainerServiceServicer_to_server, "trainer", FakeTrainer()),
        "r0": await serve(rpb_grpc.add_RolloutServiceServicer_to_server, "r0", FakeRollout("r0")),
        "r1": await serve(rpb_grpc.add_RolloutServiceServicer_to_server, "r1", FakeRollout("r1")),
    }
    addresses["sync"] = await serve(
        spb_grpc.add_SynchronizerServiceServicer_to_server, "sync", FakeSynchronizer([addresses["r0"], addresses["r1"]])
    )
    yield addresses, fakes
    for server in servers:
        await server.stop(0)


async def test_trainer_adapter_round_trip(cluster) -> None:
    addresses, fakes = cluster
    trainer = GrpcTrainer(addresses["trainer"], timeout=10)
    assert (await trainer.get_state()).step == 0
    traj = trajectory(task(1), response=3)
    traj.advantage = 0.5
    batch = build_train_batch([traj], target_version=0)
    cfg = config(algorithm={"name": "dapo", "loss": {"aggregation": "token_mean"}})
    result = await trainer.train_step(batch, cfg.loss, micro_batch_size=2, expected_step=0)
    assert (result.step, result.version, result.tokens) == (1, 1, 6) and result.metrics["loss"] == 0.0
    sent = fakes["trainer"].requests[0]
    assert sent.loss.kind == tpb.LOSS_KIND_DAPO and sent.loss.clip_high == pytest.approx(0.28)
    assert sent.loss.aggregation == tpb.LOSS_AGGREGATION_TOKEN_MEAN and sent.micro_batch_size == 2
    assert tensor_from_proto(sent.batch.advantages).tolist() == [0.5]
    with pytest.raises(FailedPrecondition, match="expected step 0"):
        await trainer.train_step(batch, cfg.loss, micro_batch_size=0, expected_step=0)
    traj.response_mask = [0, 0, 0]
    with pytest.raises(InvalidArgument, match="selects no tokens"):
        await trainer.train_step(build_train_batch([traj], 1), cfg.loss, micro_batch_size=0, expected_step=1)
    assert await trainer.load_checkpoint(None) is None
    path = await trainer.save_checkpoint(b'{"loader": {}}')
    restored = await trainer.load_checkpoint(None)
    assert restored.path == path and restored.client_state == b'{"loader": {}}'
    exported = await trainer.export_weights(WeightSource("checkpoint", path="/shared"))
    assert exported.path == "/shared/v1"
    await trainer.close()


async def test_rollout_adapter_round_trip_and_unreachable_replicas(cluster) -> None:
    addresses, fakes = cluster
    engine = GrpcRolloutEngine(addresses["r0"], timeout=10)
    gens = await engine.generate(
        [PromptInput("a", messages=[{"role": "user", "content": "hi"}]), PromptInput("b", token_ids=[4, 5])],
        SamplingSpec(n=2, max_tokens=8),
    )
    assert [len(g) for g in gens] == [2, 2] and gens[1][0].prompt_token_ids == [4, 5]
    g = gens[0][0]
    assert len(g.completion_token_ids) == len(g.completion_logprobs) <= 8
    assert all(x.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for x in gens[0] + gens[1])
    assert await engine.tokenize(text="a b c") == [7, 7, 7]
    assert await engine.tokenize(messages=[{"role": "user", "content": "x"}]) == [1, 2, 3]
    assert await engine.update_weights(3, WeightSource("checkpoint", path="/w/v3"), pause_mode="wait") == 3
    assert await engine.weight_version() == 3
    assert fakes["r0"].updates[0].checkpoint.path == "/w/v3" and fakes["r0"].updates[0].pause_mode == cpb.PAUSE_MODE_WAIT
    with pytest.raises(FailedPrecondition):
        await engine.update_weights(2, WeightSource("checkpoint", path="/w/v2"), pause_mode="keep")
    await engine.close()
    dead = GrpcRolloutEngine("127.0.0.1:1", timeout=2, max_attempts=1)
    with pytest.raises(Unavailable):
        await dead.weight_version()
    await dead.close()
    assert await GrpcHealthProbe("r0", addresses["r0"]).check()
    assert not await GrpcHealthProbe("dead", "127.0.0.1:1", timeout=1).check()


async def test_synchronizer_adapter_configures_the_policy_and_reads_versions(cluster) -> None:
    addresses, fakes = cluster
    sync = GrpcSynchronizer(addresses["sync"], trainer_id="trainer-0")
    await sync.configure_policy(style="dynamic_by_explorer", method="nccl", interval=2, offset=0, timeout_seconds=9,
                                mode="batch-async", max_staleness=3)
    policy = fakes["sync"].policy
    assert policy.style == cpb.SYNC_STYLE_DYNAMIC_BY_EXPLORER and policy.sync_timeout_seconds == 9
    # The mode tells replicas what to wait for before they generate for a step.
    assert policy.rollout_wait == spb.ROLLOUT_WAIT_STALENESS and policy.max_staleness == 3
    await sync.configure_policy(style="fixed", method="memory", interval=1, offset=0, timeout_seconds=9,
                                mode="sync", max_staleness=0)
    assert fakes["sync"].policy.rollout_wait == spb.ROLLOUT_WAIT_DUE_VERSION
    assert await sync.latest_version() == 7
    group = await sync.allocate_group(4, [], 30)
    assert group == NcclGroup("g1", "10.0.0.1:29500", 1, "gloo", {"trainer-0": 0},
                              synchronizer_address=addresses["sync"])
    # A replica told of a group (by UpdateWeights, the operator path) gets its rank and where to report.
    group = await sync.allocate_group(4, ["rollout-1"], 30)
    replica = GrpcRolloutEngine(addresses["r1"], timeout=10, name="rollout-1")
    assert await replica.update_weights(4, WeightSource("nccl", group=group), pause_mode="abort") == 4
    sent = fakes["r1"].updates[-1].nccl
    assert (sent.group_id, sent.rendezvous_address, sent.world_size, sent.rank, sent.backend) == (
        "g1", "10.0.0.1:29500", 2, 1, "gloo")
    assert sent.synchronizer_address == addresses["sync"]
    await replica.close()
    await sync.close()


async def test_a_whole_standalone_run_over_grpc(cluster, tmp_path) -> None:
    """Without a synchronizer the controller moves the weights itself (UpdateWeights to every replica)."""
    addresses, fakes = cluster
    cfg = config(
        mode="batch-async",
        run={"max_steps": 4},
        services={"trainer": {"address": addresses["trainer"]},
                  "rollout": [{"address": addresses["r0"]}, {"address": addresses["r1"]}],
                  "health_interval_seconds": 0.2},
        staleness={"threshold": 1},
        sync={"method": "checkpoint", "checkpoint_dir": str(tmp_path), "interval": 2},
        checkpoint={"at_end": True},
    )
    services = connect(cfg, token="unused")
    p = build_pipeline(cfg, services, keep_history=True, retry_backoff_seconds=0.01)
    summary = await asyncio.wait_for(run(p), 30)
    await services.close()
    assert summary.steps == 4 and summary.final_version == 4
    assert fakes["trainer"].sim.checkpoints  # saved at the end, with the data cursor
    # The local FIXED(2, 0) policy said "sync" after steps 2 and 4: replicas loaded those versions.
    # (The run ends right after step 4's export; replicas loading v4 is cut short.)
    loaded = {u.version for name in ("r0", "r1") for u in fakes[name].updates}
    assert 2 in loaded and loaded <= {2, 4}
    assert fakes["sync"].registered == []  # nothing is registered without a synchronizer
    for version, versions in fakes["trainer"].sim.trained:
        assert all(version - v <= 1 for v in versions)
