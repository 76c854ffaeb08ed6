"""Assembles the trainer service for the server bootstrap.

The model loads in `startup`, in a worker thread: the event loop keeps
answering health checks (NOT_SERVING) meanwhile, and SERVING is reported only
once the policy is ready. With `sync.synchronizer_address` set, the loaded
trainer then registers with the synchronizer, heartbeats its step and
weight version, and publishes every version the synchronizer's policy makes
due after the step that made it (`services.trainer.link`); graceful shutdown
deregisters it. With `parallel.world_size` N > 1 this process is rank 0 of
a sharded policy and starts the other N - 1 ranks while it loads
(`services.trainer.distributed`); they stop with it.
"""

from __future__ import annotations

import gc

import services.trainer.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.models.check import require_model_dir
from flywheel.runtime.auth import Scope
from flywheel.runtime.server import ServiceSpec
from flywheel.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.trainer.config import TrainerConfig
from services.trainer.servicer import TrainerServicer
from services.trainer.training import TrainingEngine

PROTO_SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
#: Every method is for the controller to call (an operator may call them too).
METHOD_SCOPES = {method.name: Scope.SERVICE for method in trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].methods}


def build(config: TrainerConfig) -> ServiceSpec:
    # Checked before anything listens: a trainer without a model must not report SERVING.
    require_model_dir(config.model.path, "trainer", ("model", "path"))
    engine = TrainingEngine(config)
    servicer = TrainerServicer(engine)
    state: dict = {"link": None, "grpc_port": 0}

    async def startup() -> None:
        await engine.run(engine.load)
        # What exists now (torch, transformers, the model: ~10^5 objects)
        # lives as long as the process; frozen, the cyclic collector stops
        # rescanning it during every training step.
        gc.collect()
        gc.freeze()
        if config.sync.synchronizer_address:
            from services.trainer.link import TrainerLink

            state["link"] = TrainerLink(config, engine, state["grpc_port"])
            state["link"].start()
            if config.sync.publish:
                servicer.after_step = state["link"].publisher.after_step
            await state["link"].presence.wait_registered(config.sync.rpc_timeout_seconds)

    async def shutdown() -> None:
        if state["link"] is not None:
            servicer.after_step = None
            await state["link"].stop()
        # A sharded policy's other ranks (parallel.world_size > 1) stop with the service.
        await engine.run(engine.close)
        # Frozen objects are never collected; extension modules (nanobind)
        # then report them as leaked at exit.
        gc.unfreeze()

    return ServiceSpec(
        name="trainer",
        proto_services=[PROTO_SERVICE],
        register=lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server),
        method_scopes=METHOD_SCOPES,
        on_bound=lambda port: state.__setitem__("grpc_port", port),
        startup=startup,
        shutdown=shutdown,
    )
