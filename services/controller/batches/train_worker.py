"""The train worker: takes ready batches and drives TrainStep on the trainer.

It knows the trainer's step and weight version (from `get_state()` or the
restored checkpoint), sends `expected_step` with every call so a trainer
that moved behind the controller's back is caught (FAILED_PRECONDITION), and
records for every trained sample the staleness it was trained at. Time spent
inside TrainStep counts as the trainer's busy time in the activity tracker;
the rest of the wall time is the pipeline's bubble.

A batch the trainer rejects as malformed (InvalidArgument) is recorded and
skipped (its tasks are not retried: the same data would fail again); any
other failure is critical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flywheel.errors import InvalidArgument
from services.controller.telemetry.activity import ActivityTracker
from services.controller.batches.batching import TrainBatch
from services.controller.domain import TrainResult
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.batches.processor import TrainBatchPool
from services.controller.protocols import Trainer


@dataclass
class TrainedRecord:
    """What was trained at one step, for metrics and for tests of the modes."""

    step: int
    trainer_version: int  # the version the batch was trained at
    sample_versions: list[int] = field(default_factory=list)
    sample_end_versions: list[int] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)


class TrainWorker:
    def __init__(
        self,
        trainer: Trainer,
        batches: TrainBatchPool,
        tracker: ActivityTracker,
        errors: ErrorReporter,
        *,
        loss,
        micro_batch_size: int = 0,
        keep_history: bool = False,
    ) -> None:
        self.trainer, self.batches, self.tracker, self.errors = trainer, batches, tracker, errors
        self.loss, self.micro_batch_size = loss, micro_batch_size
        self.step = 0
        self.version = 0
        self.samples_trained = 0
        self.tokens_trained = 0
        self.keep_history = keep_history
        self.history: list[TrainedRecord] = []

    async def sync_state(self) -> None:
        state = await self.trainer.get_state()
        self.step, self.version = state.step, state.version

    async def next_batch(self) -> TrainBatch | None:
        return await self.batches.get()

    async def train(self, batch: TrainBatch) -> TrainResult | None:
        """One TrainStep; None when the trainer rejected the batch (recorded, skipped)."""
        at_version = self.version
        try:
            with self.tracker.track("trainer", f"step {self.step + 1}"):
                result = await self.trainer.train_step(
                    batch, self.loss, micro_batch_size=self.micro_batch_size, expected_step=self.step
                )
        except InvalidArgument as exc:
            self.errors.report("train_worker", exc, severity="error", context={"step": self.step + 1})
            return None
        except Exception as exc:
            self.errors.report("train_worker", exc, severity="critical", context={"step": self.step + 1})
            raise
        self.step, self.version = result.step, result.version
        self.samples_trained += batch.size
        self.tokens_trained += batch.tokens
        if self.keep_history:
            self.history.append(
                TrainedRecord(
                    step=result.step,
                    trainer_version=at_version,
                    sample_versions=[t.version_start for t in batch.trajectories],
                    sample_end_versions=[t.version_end for t in batch.trajectories],
                    task_ids=[t.task.id for t in batch.trajectories],
                )
            )
        return result
