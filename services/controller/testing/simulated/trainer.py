"""The simulated trainer: train steps of drawn durations, publishing each version the synchronizer's
policy makes due."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.synchronizer.types import Role
from services.controller.domain import RestoredCheckpoint, TrainerState, TrainResult
from services.controller.testing.simulated.clock import Draw, constant
from services.controller.testing.simulated.synchronizer import TRAINER_ID, SimulatedSynchronizer


@dataclass
class SimulatedTrainer:
    train_time: Draw = field(default_factory=lambda: constant(0.01))
    #: Time to publish a version.
    export_time: Draw = field(default_factory=lambda: constant(0.0))
    step: int = 0
    version: int = 0
    #: (trainer version at training, the oldest version of the tokens each sample trains) per step.
    trained: list[tuple[int, list[int]]] = field(default_factory=list)
    #: (trainer version at training, the version of every token trained) per step.
    trained_tokens: list[tuple[int, list[int]]] = field(default_factory=list)
    checkpoints: dict[str, tuple[int, int, bytes]] = field(default_factory=dict)
    #: Versions published, in order.
    published: list[int] = field(default_factory=list)
    synchronizer: SimulatedSynchronizer | None = None
    _busy: bool = False
    _publishing: asyncio.Lock | None = None

    def attach(self, synchronizer: SimulatedSynchronizer) -> None:
        self.synchronizer = synchronizer
        synchronizer.register(Role.TRAINER, TRAINER_ID)
        synchronizer.wake_trainer = self.wake

    async def get_state(self) -> TrainerState:
        return TrainerState(self.step, self.version)

    async def train_step(self, batch, loss, *, micro_batch_size: int, expected_step: int | None) -> TrainResult:
        if self._busy:
            raise FailedPrecondition("a train step is already running")
        if expected_step is not None and expected_step != self.step:
            raise FailedPrecondition(f"expected step {expected_step}, trainer is at {self.step}")
        versions, mask = batch.tensors["weight_versions"], batch.tensors["loss_mask"] > 0
        if versions.dim() == 1:  # per sample
            versions = versions[:, None].expand(mask.shape)
        tokens = versions[mask].tolist()
        if not tokens:
            raise InvalidArgument("batch.loss_mask: selects no tokens")
        if max(tokens) > self.version:
            raise FailedPrecondition(f"tokens from version {max(tokens)} but the trainer is at {self.version}")
        oldest = [int(versions[row][mask[row]].min()) for row in range(mask.shape[0]) if mask[row].any()]
        self._busy = True
        try:
            await asyncio.sleep(self.train_time())
        finally:
            self._busy = False
        self.trained.append((self.version, oldest))
        self.trained_tokens.append((self.version, tokens))
        self.step += 1
        self.version += 1
        await self.publish_if_due()  # before the step answers, as the real trainer does
        return TrainResult(self.step, self.version, batch.tokens, {"loss": 0.0, "grad_norm": 1.0})

    async def publish_if_due(self) -> None:
        sync = self.synchronizer
        if sync is None:
            return
        if self._publishing is None:
            self._publishing = asyncio.Lock()
        async with self._publishing:
            decision = sync.need_sync(TRAINER_ID, self.step)
            if decision.need_sync and self.step >= 1 and self.version > sync.latest:
                version = self.version
                await asyncio.sleep(self.export_time())
                self.published.append(version)
                sync.commit(version)

    def wake(self) -> None:
        """The synchronizer wants a version (a replica asked, or the run needs one): ask between steps."""
        asyncio.ensure_future(self.publish_if_due())

    async def save_checkpoint(self, client_state: bytes) -> str:
        path = f"sim://global_step_{self.step}"
        self.checkpoints[path] = (self.step, self.version, client_state)
        return path

    async def load_checkpoint(self, path: str | None) -> RestoredCheckpoint | None:
        if not self.checkpoints:
            return None
        path = path or max(self.checkpoints, key=lambda p: self.checkpoints[p][0])
        step, version, state = self.checkpoints[path]
        self.step, self.version = step, version
        return RestoredCheckpoint(path, step, version, state)
