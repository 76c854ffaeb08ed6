"""What the pipeline needs from each remote service, as Protocols.

The controller's domain code talks to these interfaces only. Two families
implement them: the gRPC adapters (`services/controller/adapters/`, the
product path) and the simulated engines (`services/controller/testing/simulated/`,
for tests and the pipeline benchmark). A user can plug in their own (e.g. an
in-process engine) without touching the pipeline.

Errors: implementations raise `flywheel.errors` exceptions: `Unavailable` or
`DeadlineExceeded` when a replica should be failed over, `FailedPrecondition`
when the caller's view is out of date, anything else for real failures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from services.controller.domain import (
    Generation,
    PromptInput,
    RestoredCheckpoint,
    SamplingSpec,
    TrainerState,
    TrainResult,
)

if TYPE_CHECKING:
    from flywheel.synchronizer.client_types import WatchEvent
    from flywheel.synchronizer.types import Component, UpdateRecord
    from services.controller.batches.batching import TrainBatch
    from services.controller.rollouts.episodes import OpenedSession, SessionRecord
    from services.controller.run_config import LossConfig


@runtime_checkable
class Trainer(Protocol):
    """Training-as-a-Service: batches in, a new weight version out."""

    async def get_state(self) -> TrainerState: ...

    async def train_step(
        self, batch: TrainBatch, loss: LossConfig, *, micro_batch_size: int, expected_step: int | None
    ) -> TrainResult: ...

    async def save_checkpoint(self, client_state: bytes) -> str:
        """Writes a checkpoint with the controller's state; returns its path."""
        ...

    async def load_checkpoint(self, path: str | None) -> RestoredCheckpoint | None:
        """Restores `path` (None: the newest); None when there is none."""
        ...


@runtime_checkable
class RolloutEngine(Protocol):
    """One rollout replica: generation with token ids, log-probs and versions."""

    #: Unique replica name (usually its address).
    name: str

    async def generate(self, prompts: Sequence[PromptInput], sampling: SamplingSpec) -> list[list[Generation]]:
        """One list of `sampling.n` generations per prompt, in order."""
        ...

    async def tokenize(
        self, *, text: str | None = None, messages: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]: ...

    async def sessions(self) -> AgentSessions:
        """The replica's agent sessions (the external worker's); FailedPrecondition where it serves none."""
        ...


@runtime_checkable
class AgentSessions(Protocol):
    """One replica's agent sessions: episode-scoped OpenAI endpoints whose calls the replica records."""

    async def open(
        self, *, ttl_seconds: float | None = None, metadata: Mapping[str, str] | None = None
    ) -> OpenedSession: ...

    async def read(self, session_id: str) -> SessionRecord:
        """The session's calls and posted reward; NotFound, or SessionLost when its records are gone."""
        ...

    async def delete(self, session_id: str) -> None: ...


@runtime_checkable
class Synchronizer(Protocol):
    """The synchronizer as the controller sees it: the run's policy, the versions it holds, its events.
    The controller moves no weights: the trainer publishes, replicas follow (weights/fleet.py)."""

    async def configure_policy(
        self, *, style: str, method: str, interval: int, offset: int, timeout_seconds: float, rollout_wait: str,
        max_staleness: int, pause_mode: str,
    ) -> None:
        """Sets the run's sync policy (the controller owns the run's config)."""
        ...

    def events(self, send_initial: bool) -> AsyncIterator[WatchEvent]:
        """The synchronizer's event stream (True: everyone's current state first)."""
        ...

    async def latest_version(self) -> int: ...

    async def components(self) -> list[Component]:
        """Every registered component as the synchronizer holds it now."""
        ...

    async def request_version(self, min_version: int, reason: str) -> int:
        """Asks for a version >= `min_version` outside the schedule (the trainer publishes it);
        returns the newest committed version now."""
        ...

    async def updates(self, version: int) -> list[UpdateRecord]:
        """The update reports of `version` the synchronizer keeps (ListUpdates): what a Watch
        stream that reconnected, or a run that started after them, did not hear."""
        ...


@runtime_checkable
class HealthProbe(Protocol):
    """Liveness of one remote service (gRPC health in the product path)."""

    name: str

    async def check(self) -> bool: ...
