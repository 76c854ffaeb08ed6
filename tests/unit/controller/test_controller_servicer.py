"""The controller's gRPC API: Start / Stop / Status / StreamMetrics, in process,
with the run's services simulated (real time, millisecond steps)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import grpc
import pytest
import yaml

from flywheel.controller.v1 import controller_pb2 as pb
from flywheel.controller.v1 import controller_pb2_grpc as pb_grpc
from flywheel.runtime.interceptors import ErrorInterceptor
from services.controller.assemble import Services
from services.controller.telemetry.metrics_log import PrometheusSink
from services.controller.ops.runs import RunManager
from services.controller.servicer import ControllerServicer
from services.controller.testing.simulated import SimulatedRolloutEngine, SimulatedTrainer, constant, simulated_services
from tests.unit.controller.controller_helpers import items


def services_for(cfg) -> Services:
    trainer = SimulatedTrainer(train_time=constant(0.005))
    engine = SimulatedRolloutEngine(gen_time=constant(0.002), rng=random.Random(0))
    return simulated_services(trainer, [engine])


def run_yaml(**overrides) -> str:
    data = {
        "run": {"name": "t", "max_steps": 5},
        "data": {"train": {"items": items(400)}},
        "worker": {"type": "math", "group_size": 2, "max_in_flight": 4},
        "algorithm": {"train_batch_size": 4},
        "mode": "fully-async",
    }
    data.update(overrides)
    return yaml.safe_dump(data)


@pytest.fixture
async def controller(tmp_path: Path):
    runs = RunManager(tmp_path / "runs", services_for, sinks=lambda: [PrometheusSink()])
    server = grpc.aio.server(interceptors=[ErrorInterceptor("controller")])
    pb_grpc.add_ControllerServiceServicer_to_server(ControllerServicer(runs), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.ControllerServiceStub(channel), runs
    await runs.close()
    await channel.close()
    await server.stop(0)


async def wait_phase(stub, phases, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        status = await stub.Status(pb.StatusRequest())
        if status.phase in phases:
            return status
        await asyncio.sleep(0.02)
    raise AssertionError(f"phase stayed {status.phase}")


async def test_a_run_from_start_to_completion(controller, tmp_path: Path) -> None:
    stub, runs = controller
    assert (await stub.Status(pb.StatusRequest())).phase == pb.RUN_PHASE_IDLE
    started = await stub.Start(pb.StartRequest(config_yaml=run_yaml(), run_id="r1"))
    assert started.run_id == "r1" and Path(started.run_dir) == tmp_path / "runs" / "r1"
    streamed = [m async for m in stub.StreamMetrics(pb.StreamMetricsRequest(after_step=0))]
    assert [m.step for m in streamed] == [1, 2, 3, 4, 5]
    status = await wait_phase(stub, {pb.RUN_PHASE_COMPLETED})
    assert status.step == 5 and status.trainer_version == 5 and status.total_steps == 5
    assert status.mode == pb.RUN_MODE_FULLY_ASYNC and "max_steps" in status.message
    assert any(m.name == "throughput/samples_per_second" for m in status.metrics)
    lines = (tmp_path / "runs" / "r1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert yaml.safe_load((tmp_path / "runs" / "r1" / "config.yaml").read_text())["mode"] == "fully-async"
    replay = [m.step async for m in stub.StreamMetrics(pb.StreamMetricsRequest(after_step=3))]
    assert replay == [4, 5]

    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("flywheel_controller_trainer_step") == 5
    assert REGISTRY.get_sample_value("flywheel_controller_samples_per_second") > 0
    assert REGISTRY.get_sample_value("flywheel_controller_component_busy_seconds", {"component": "trainer"}) > 0
    assert REGISTRY.get_sample_value("flywheel_controller_staleness_count") >= 20


async def test_bad_configs_are_invalid_argument_naming_the_field(controller) -> None:
    stub, _ = controller
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Start(pb.StartRequest(config_yaml=run_yaml(worker={"group_sise": 2})))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker.group_sise: unknown field" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Start(pb.StartRequest(config_yaml=run_yaml(reward={"name": "nope"})))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reward.name" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Stop(pb.StopRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_run_writes_only_inside_the_runs_directory(controller, tmp_path: Path) -> None:
    stub, runs = controller
    for output_dir, code in [(str(tmp_path / "elsewhere"), grpc.StatusCode.PERMISSION_DENIED),
                             ("../elsewhere", grpc.StatusCode.PERMISSION_DENIED),
                             ("n" * 300, grpc.StatusCode.INVALID_ARGUMENT)]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Start(pb.StartRequest(config_yaml=run_yaml(run={"name": "t", "output_dir": output_dir})))
        assert err.value.code() == code and "run.output_dir" in err.value.details()
    assert not (tmp_path / "elsewhere").exists() and runs.run_id == ""
    started = await stub.Start(pb.StartRequest(config_yaml=run_yaml(run={"name": "t", "max_steps": 2,
                                                                          "output_dir": "mine"})))
    assert Path(started.run_dir) == tmp_path / "runs" / "mine"
    await wait_phase(stub, {pb.RUN_PHASE_COMPLETED})


async def test_one_run_at_a_time_and_stop_with_a_checkpoint(controller) -> None:
    stub, runs = controller
    await stub.Start(pb.StartRequest(config_yaml=run_yaml(run={"name": "long", "max_steps": 100000})))
    await wait_phase(stub, {pb.RUN_PHASE_RUNNING})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Start(pb.StartRequest(config_yaml=run_yaml()))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    while (await stub.Status(pb.StatusRequest())).step < 3:
        await asyncio.sleep(0.01)
    stopped = await stub.Stop(pb.StopRequest(checkpoint=True, grace_seconds=10))
    assert stopped.checkpoint_path.startswith("sim://global_step_")
    status = await stub.Status(pb.StatusRequest())
    assert status.phase == pb.RUN_PHASE_COMPLETED and status.message == "stop requested"
    assert json.loads(runs.pipeline.trainer.checkpoints[stopped.checkpoint_path][2])["loader"]["pending"]
