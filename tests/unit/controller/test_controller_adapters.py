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
from services.controller.batches.batching import build_train_batch
from services.controller.domain import FinishReason, PromptInput, SamplingSpec
from services.controller.loop import run
from services.controller.testing.simulated import SimulatedRolloutEngine, SimulatedTrainer, constant
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


class FakeRollout(rpb_grpc.RolloutServiceServicer):
    def __init__(self, name: str) -> None:
        self.sim = SimulatedRolloutEngine(name=name, gen_time=constant(0.003), rng=random.Random(1))
        self.run_steps: list[int] = []

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
        self.run_steps.append(request.run_step)
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


class FakeSynchronizer(spb_grpc.SynchronizerServiceServicer):
    """TEST DOUBLE: a registry of the two replicas (Watch, Status), the policy it is handed and the
    versions asked for; it moves no weights."""

    def __init__(self, rollout_addresses: list[str]) -> None:
        self.addresses = rollout_addresses
        self.policy = spb.ConfigurePolicyRequest(sync_interval=1)
        self.requested: list[tuple[int, str]] = []

    def components(self) -> list[cpb.ComponentStatus]:
        return [
            cpb.ComponentStatus(
                identity=cpb.ComponentIdentity(id=f"rollout-{i}", address=a, role=cpb.COMPONENT_ROLE_ROLLOUT),
                state=cpb.COMPONENT_STATE_RUNNING, weight_version=0,
            )
            for i, a in enumerate(self.addresses)
        ]

    async def ConfigurePolicy(self, request, context):
        self.policy = request
        return spb.ConfigurePolicyResponse()

    async def Status(self, request, context):
        return spb.StatusResponse(latest_version=7, components=self.components())

    async def RequestVersion(self, request, context):
        self.requested.append((request.min_version, request.reason))
        return spb.RequestVersionResponse(latest_version=7)

    async def Watch(self, request, context):
        if request.send_initial:
            for c in self.components():
                yield spb.WatchResponse(kind=spb.EVENT_KIND_STATE_CHANGED, component=c, latest_version=7)
        await asyncio.Event().wait()


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
    await engine.close()
    dead = GrpcRolloutEngine("127.0.0.1:1", timeout=2, max_attempts=1)
    with pytest.raises(Unavailable):
        await dead.tokenize(text="x")
    await dead.close()
    assert await GrpcHealthProbe("r0", addresses["r0"]).check()
    assert not await GrpcHealthProbe("dead", "127.0.0.1:1", timeout=1).check()


async def test_synchronizer_adapter_configures_the_policy_reads_versions_and_asks_for_them(cluster) -> None:
    addresses, fakes = cluster
    sync = GrpcSynchronizer(addresses["sync"])
    await sync.configure_policy(style="dynamic_by_explorer", method="nccl", interval=2, offset=0, timeout_seconds=9,
                                rollout_wait="staleness", max_staleness=3, pause_mode="abort")
    policy = fakes["sync"].policy
    assert policy.style == cpb.SYNC_STYLE_DYNAMIC_BY_EXPLORER and policy.sync_timeout_seconds == 9
    assert policy.rollout_wait == spb.ROLLOUT_WAIT_STALENESS and policy.max_staleness == 3
    assert policy.pause_mode == cpb.PAUSE_MODE_ABORT
    assert await sync.latest_version() == 7
    assert await sync.request_version(9, "validation at version 9") == 7
    assert fakes["sync"].requested == [(9, "validation at version 9")]
    await sync.close()


async def test_a_whole_run_over_grpc(cluster, tmp_path) -> None:
    """The replicas come from the synchronizer's registry; the controller moves no weights."""
    addresses, fakes = cluster
    cfg = config(
        mode="fully-async",
        run={"max_steps": 4},
        services={"trainer": {"address": addresses["trainer"]}, "synchronizer": {"address": addresses["sync"]},
                  "health_interval_seconds": 0.2},
        sync={"interval": 2, "pause_mode": "wait"},
        checkpoint={"at_end": True},
    )
    services = connect(cfg, token="unused")
    p = build_pipeline(cfg, services, keep_history=True, retry_backoff_seconds=0.01)
    summary = await asyncio.wait_for(run(p), 30)
    await services.close()
    assert summary.steps == 4 and summary.final_version == 4
    assert fakes["trainer"].sim.checkpoints  # saved at the end, with the data cursor
    # Both registered replicas took work, each generation tagged with its run step.
    assert all(fakes[name].run_steps and min(fakes[name].run_steps) >= 1 for name in ("r0", "r1"))
    assert fakes["sync"].policy.pause_mode == cpb.PAUSE_MODE_WAIT and fakes["sync"].policy.sync_interval == 2
    assert fakes["sync"].requested == [], "version 0 is the base model: nothing to ask for at the start"


def test_a_samples_version_spans_reach_the_generation_and_spans_that_do_not_cover_it_are_data_loss() -> None:
    from flywheel.common.provenance import VersionSpan
    from flywheel.errors import DataLoss
    from services.controller.adapters.rollout import generation

    sample = cpb.Sample(prompt_token_ids=[1], completion_token_ids=[5, 6, 7], completion_logprobs=[-1.0] * 3,
                        finish_reason=finish_reason_to_pb("length"),
                        weight_version_start=2, weight_version_end=3,
                        weight_version_spans=[cpb.VersionSpan(version=2, start=0, end=1),
                                              cpb.VersionSpan(version=3, start=1, end=3)])
    assert generation(sample).version_spans == [VersionSpan(2, 0, 1), VersionSpan(3, 1, 3)]
    del sample.weight_version_spans[1]
    with pytest.raises(DataLoss, match="cover 1 tokens, the completion has 3"):
        generation(sample)
