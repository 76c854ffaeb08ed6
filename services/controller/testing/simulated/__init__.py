"""Simulated services, for tests and the pipeline benchmark only.

`SimulatedTrainer` (trainer.py), `SimulatedRolloutEngine` (rollout.py) and
`SimulatedSynchronizer` (synchronizer.py) implement the controller's Protocols
with generation, training and publishing times drawn from given distributions
(clock.py). They keep the one road of a real run, with the rules the real
services keep, through the same code where it is shared:
- the synchronizer holds the run's policy and versions and answers NeedSync
  with `flywheel.synchronizer.policy` (FIXED, DYNAMIC, versions asked for);
- the trainer publishes what the policy makes due after each step (before
  the step answers) and whenever the synchronizer wants a version; it
  rejects samples from a version newer than its own and a wrong
  expected_step;
- each replica follows by its own run steps: it asks NeedSync at the first
  request of a step, holds a generation back for what the policy's
  `rollout_wait` says (`policy.required_version`), swaps all at once under
  the policy's pause mode (keep, wait, abort) and reports every update; a
  fault set on it (`fail_updates`) makes an update fail verification, as a
  replica that loaded a tensor wrong would.
Left out: DYNAMIC requests lapsing, transfers that fail midway, rewinds.
Nothing here is on the product path: real runs use
`services/controller/adapters/`. services.py wires a simulated run's services;
a run on simulated services runs on the virtual clock of clock.py
(`run_virtual`).
"""

from services.controller.testing.simulated.clock import (
    Draw, SimulationDeadlock, VirtualTimeLoop, constant, lognormal, normal, run_virtual,
)
from services.controller.testing.simulated.rollout import SimulatedRolloutEngine
from services.controller.testing.simulated.services import SimulatedHealthProbe, connect_simulated, simulated_services
from services.controller.testing.simulated.synchronizer import TRAINER_ID, SimulatedSynchronizer
from services.controller.testing.simulated.trainer import SimulatedTrainer

__all__ = [
    "Draw", "SimulationDeadlock", "VirtualTimeLoop", "constant", "lognormal", "normal", "run_virtual",
    "SimulatedRolloutEngine", "SimulatedHealthProbe", "connect_simulated", "simulated_services",
    "TRAINER_ID", "SimulatedSynchronizer", "SimulatedTrainer",
]
