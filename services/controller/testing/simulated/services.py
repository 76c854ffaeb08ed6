"""A simulated run's services: the trainer and replicas registered with one simulated synchronizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flywheel.synchronizer.types import Role
from services.controller.testing.simulated.rollout import SimulatedRolloutEngine
from services.controller.testing.simulated.synchronizer import SimulatedSynchronizer
from services.controller.testing.simulated.trainer import SimulatedTrainer


def connect_simulated(
    trainer: SimulatedTrainer, engines: Sequence[Any],
    synchronizer: SimulatedSynchronizer | None = None,
) -> SimulatedSynchronizer:
    """Registers the simulated trainer and replicas with a simulated synchronizer (a new one by
    default). A replica of another kind (a test's own) is registered, and follows nothing."""
    synchronizer = synchronizer or SimulatedSynchronizer()
    trainer.attach(synchronizer)
    for engine in engines:
        if isinstance(engine, SimulatedRolloutEngine):
            engine.attach(synchronizer)
        else:
            synchronizer.register(Role.ROLLOUT, engine.name)
    return synchronizer


def simulated_services(
    trainer: SimulatedTrainer, engines: Sequence[Any], synchronizer: SimulatedSynchronizer | None = None,
    probes: Sequence[Any] = (),
) -> Any:
    """The `Services` of a simulated run: the trainer and replicas following one simulated synchronizer."""
    from services.controller.assemble import Services

    return Services(trainer, list(engines), synchronizer=connect_simulated(trainer, engines, synchronizer),
                    probes=list(probes))


@dataclass
class SimulatedHealthProbe:
    name: str
    healthy: Callable[[], bool] = lambda: True

    async def check(self) -> bool:
        return self.healthy()
