"""The pipeline: the run's components wired together, and the verbs the main
loop (loop.py) calls. Each verb delegates to one component; `assemble.py`
builds a Pipeline from a RunConfig and a set of engines (gRPC or simulated).

A Pipeline holds collaborators; what a session has done is its `state`
(RunState). Whoever drives it (the local launcher, a test) extends its verbs
through `hooks` (PipelineHooks), never by replacing its methods.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.controller.telemetry.activity import ActivityTracker, now
from services.controller.rollouts.balancer import EnginePool
from services.controller.batches.batching import TrainBatch
from services.controller.tasks.loader import DataLoader
from services.controller.domain import TrainResult
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.rollouts.liveness import LivenessMonitor
from services.controller.telemetry.metrics_log import MemorySink, MetricsLog
from services.controller.weights.observer import SynchronizerObserver
from services.controller.batches.pool import TrajectoryPool
from services.controller.batches.processor import AlgorithmProcessor, TrainBatchPool
from services.controller.protocols import Trainer
from services.controller.rollouts.manager import RolloutManager
from services.controller.run_config import RunConfig
from services.controller.batches.sample_age import SampleAgeReport, token_age_metrics
from services.controller.batches.staleness import StalenessGate
from services.controller.batches.train_worker import TrainWorker
from services.controller.tasks.judge import RemoteJudge
from services.controller.tasks.teacher import Teacher
from services.controller.rollouts.validation import Validator
from services.controller.weights.fleet import Fleet

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    steps: int
    samples: int
    tokens: int
    wall_seconds: float
    samples_per_second: float
    trainer_idle_fraction: float
    stop_reason: str
    final_version: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RunState:
    """What this session of the run has done and been asked so far. The pipeline's verbs
    write it; Stop requests, the launcher, Status and the status page read it. Everything
    else a Pipeline holds is a collaborator."""

    #: Steps trained this session (from the resumed step when the launcher counts resumed ones).
    steps_done: int = 0
    #: The trainer's step when this session's start was done (the launcher sets it; 0 otherwise).
    resumed_at_step: int = 0
    #: start() is done: resumed, the policy handed over, the start version asked for, its hooks run.
    started: bool = False
    stop_reason: str = ""
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by a Stop request that asks for a checkpoint.
    checkpoint_on_stop: bool = False
    last_checkpoint_path: str = ""
    #: The step the last checkpoint holds (written, or resumed from): none is written twice.
    last_checkpoint_step: int = -1
    #: Validations and checkpoints of this session, oldest first (the status page's timeline).
    milestones: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=500))
    #: Age of the trained samples by completion length (staleness/age_*/<bucket>).
    sample_ages: SampleAgeReport = field(default_factory=SampleAgeReport)
    #: Tokens past the staleness bound in the batches trained so far (masked, or corrected).
    stale_tokens_trained: int = 0
    #: Kept sets and constrained tokens of the batches trained so far (TrainBatch.sampler_counts).
    sampler_counts: Counter[str] = field(default_factory=Counter)
    #: When the first batch arrived, and the trainer's busy seconds then (idle time counts from it).
    first_batch_at: float | None = None
    busy_at_first_batch: float = 0.0
    #: When the last step was recorded (time/step_seconds).
    last_record_at: float = 0.0
    #: Samples pooled up to the last record (rollout/new_samples).
    pooled_before: int = 0


#: A callback of start(), awaited with the pipeline.
StartHook = Callable[["Pipeline"], Awaitable[None]]
#: A callback of record(): a trained step's batch, result and metrics.
RecordHook = Callable[[TrainBatch, TrainResult, dict[str, float]], None]


@dataclass
class PipelineHooks:
    """Where the pipeline's verbs call out, in the order the callbacks were added. A hook
    that raises fails the verb, as the verb's own code would."""

    #: After a resume (`resume.from` not none, whether or not a checkpoint was found), before
    #: anything else of the start: the trainer holds the checkpoint's step and version.
    after_resume: list[StartHook] = field(default_factory=list)
    #: At the end of start(): the policy handed over, the start version asked for.
    after_start: list[StartHook] = field(default_factory=list)
    #: Each trained step's record, with its metrics, before they are written: what a hook
    #: writes is on disk by the time metrics.jsonl shows the step.
    on_record: list[RecordHook] = field(default_factory=list)


@dataclass
class Pipeline:
    config: RunConfig
    trainer: Trainer
    engines: EnginePool
    loader: DataLoader
    pool: TrajectoryPool
    gate: StalenessGate
    rollouts: RolloutManager
    processor: AlgorithmProcessor
    batches: TrainBatchPool
    train_worker: TrainWorker
    fleet: Fleet
    tracker: ActivityTracker
    errors: ErrorReporter
    metrics: MetricsLog
    memory: MemorySink
    validator: Validator | None = None
    liveness: LivenessMonitor | None = None
    observer: SynchronizerObserver | None = None
    run_dir: Path | None = None
    #: The remote judge the reward is (reward.judge), and what closes its connections.
    judge: RemoteJudge | None = None
    close_judge: Callable[[], Awaitable[None]] | None = None
    #: The teacher of on-policy distillation (algorithm.teacher); Services.close closes its connections.
    teacher: Teacher | None = None
    state: RunState = field(default_factory=RunState)
    hooks: PipelineHooks = field(default_factory=PipelineHooks)
    _background: list[asyncio.Task] = field(default_factory=list)

    # -- start ----------------------------------------------------------------
    async def start(self) -> None:
        await self.rollouts.worker.start()  # first: a worker that cannot start (its environment) stops the run here
        self.tracker.start_clock()
        self.state.last_record_at = now()
        if self.observer is not None:
            # First: with membership from the registry, replicas join the pool through it.
            self._background.append(asyncio.ensure_future(self.observer.run()))
        if self.liveness is not None:
            self._background.append(asyncio.ensure_future(self.liveness.run()))
        await self.train_worker.sync_state()
        if self.config.resume.from_ != "none":
            await self._resume(self.config.resume.from_)
            for hook in self.hooks.after_resume:
                await hook(self)
        version = self.train_worker.version
        self.gate.base_version = version
        await self._first_replica()
        await self._nobody_ahead_of(version)
        await self.fleet.configure()
        # A resumed run's version is off the schedule: the trainer publishes it when asked.
        await self.fleet.need(version, f"the run starts at version {version}")
        self.gate.set_rollout_version(version)
        for hook in self.hooks.after_start:
            await hook(self)
        self.state.started = True

    async def _nobody_ahead_of(self, version: int, settle_seconds: float = 5.0) -> None:
        """No replica may serve weights newer than the trainer's (they died with an earlier trainer),
        as the synchronizer holds them now; one that is going back (a rewind) is given
        `settle_seconds` for its report to arrive before the run stops."""
        deadline = now() + settle_seconds
        while ahead := await self.fleet.ahead_of(version):
            if now() > deadline:
                self.errors.report(
                    "controller", f"rollout replicas {ahead} serve weights newer than the trainer's version {version}; "
                    "restart them", severity="critical",
                )
                self.errors.raise_if_stopped()
            await asyncio.sleep(0.1)

    async def _first_replica(self) -> None:
        """Waits until some rollout replica serves (membership from the registry starts empty)."""
        limit = self.config.services.wait_for_rollout_seconds
        deadline = now() + limit
        while not self.engines.healthy():
            if now() > deadline:
                self.errors.report("controller", f"no rollout replica registered and served within {limit:g} s",
                                   severity="critical")
                self.errors.raise_if_stopped()
            await asyncio.sleep(0.2)

    async def _resume(self, source: str) -> None:
        restored = await self.trainer.load_checkpoint(None if source == "latest" else source)
        if restored is None:
            log.info("no checkpoint to resume from: starting fresh")
            return
        self.train_worker.step, self.train_worker.version = restored.step, restored.version
        if restored.client_state:
            state = json.loads(restored.client_state)
            self.loader.load_state_dict(state["loader"])
        log.info("resumed from %s at step %d (version %d)", restored.path, restored.step, restored.version)

    def start_rollouts(self) -> None:
        self.rollouts.start()
        self._background.append(asyncio.ensure_future(self._guard("algorithm_processor", self.processor.run())))
        self._background.append(asyncio.ensure_future(self._guard("controller", self._watch_replicas())))

    async def _watch_replicas(self) -> None:
        """Stops the run once no rollout replica has served for services.wait_for_rollout_seconds:
        rollouts wait for one (RolloutManager), and a wait with no end would be a hang."""
        limit = self.config.services.wait_for_rollout_seconds
        while True:
            while self.engines.healthy():
                await asyncio.sleep(0.5)
            if not await self.engines.until_one_serves(limit):
                self.errors.report(
                    "controller", f"no rollout replica served for {limit:g} s (services.wait_for_rollout_seconds)",
                    severity="critical")
                return

    async def _guard(self, module: str, work: Any) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead background component must stop the loop, not hang it
            self.errors.report(module, exc, severity="critical")

    # -- the loop's verbs -----------------------------------------------------
    def finished(self) -> bool:
        max_steps = self.config.run.max_steps
        if max_steps is not None and self.state.steps_done >= max_steps:
            self.state.stop_reason = self.state.stop_reason or f"reached run.max_steps = {max_steps}"
            return True
        if self.errors.should_stop:
            self.state.stop_reason = self.errors.stop_reason or "error"
            return True
        if self.state.stop_requested.is_set():
            self.state.stop_reason = self.state.stop_reason or "stop requested"
            return True
        return False

    async def next_batch(self) -> TrainBatch | None:
        if not self.batches.closed and (ready := self.batches.get_nowait()) is not None:
            # Fast path: a waiting batch goes to the trainer before the processor
            # (woken by the freed slot) takes the event loop to build the next one.
            return self._arrived(ready)
        done, batch = await self._unless_stopped(self.train_worker.next_batch())
        return self._arrived(batch) if done else None

    async def _unless_stopped(self, work: Any) -> tuple[bool, Any]:
        """(True, result) of `work`, or (False, None) if the run is told to stop
        first (an error policy, a Stop RPC): a hung call must not hold the run."""
        task = asyncio.ensure_future(work)
        stoppers = [asyncio.ensure_future(self.errors.stopped.wait()), asyncio.ensure_future(self.state.stop_requested.wait())]
        await asyncio.wait([task, *stoppers], return_when=asyncio.FIRST_COMPLETED)
        for s in stoppers:
            s.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.finished()  # records why
            return False, None
        return True, task.result()

    def _arrived(self, batch: TrainBatch | None) -> TrainBatch | None:
        if batch is None:
            self.state.stop_reason = self.state.stop_reason or "data exhausted"
        elif self.state.first_batch_at is None:
            self.state.first_batch_at = now()
            self.state.busy_at_first_batch = self.tracker.busy_seconds("trainer")
        return batch

    async def weights_verified(self, batch: TrainBatch) -> bool:
        """The fleet's verdict on every weight version the batch's tokens came from (weights/fleet.py):
        True once a replica verified each, which it reported before generating on it, so normally at
        once. Within sync.verify_timeout_seconds, or False: a version nobody proved (every replica
        failed or could not measure it, and the synchronizer's policy does not accept that) is not
        trained on in any mode; the critical error names each replica's verdict, and the run stops
        (errors.policy), as a failed weight sync fails a verl job. Replicas keep their old weights
        by themselves (a failed update leaves a replica quarantined, on no traffic). False as well,
        with nothing given up, when the run is told to stop meanwhile."""
        versions = {v for t in batch.trajectories
                    for v in (t.version_start, t.version_end, *(x for turn in t.turn_versions for x in turn))}
        done, answer = await self._unless_stopped(self.fleet.until_usable(versions))
        if not done:
            return False
        verdicts, _ = answer
        if not all(v.usable for v in verdicts):
            self.not_trained(batch)
        for verdict in verdicts:
            if not verdict.usable:
                self.errors.report(
                    "controller", f"no rollout replica verified weight version {verdict.version} within "
                    f"{self.fleet.verify_timeout_seconds:g} s (sync.verify_timeout_seconds); the batch of step "
                    f"{self.train_worker.step + 1} holds tokens generated on it and is not trained. "
                    f"{verdict.describe()}", severity="critical")
            elif not verdict.verified:
                log.warning("training on tokens of version %d, which no replica verified: the synchronizer's policy "
                            "accepts unverified updates (%s)", verdict.version, verdict.describe())
        return all(v.usable for v in verdicts)

    def not_trained(self, batch: TrainBatch) -> None:
        """The batch is given up without a step: later batches train one version earlier, and its tasks end."""
        self.gate.batch_not_trained()
        for task_id in {t.task.id for t in batch.trajectories}:
            self.rollouts.finish(task_id)

    async def train(self, batch: TrainBatch) -> TrainResult | None:
        done, result = await self._unless_stopped(self.train_worker.train(batch))
        if not done:
            return None
        if result is None:
            self.not_trained(batch)
            return None
        for task_id in {t.task.id for t in batch.trajectories}:
            self.rollouts.finish(task_id)
        self.state.steps_done += 1
        return result

    def weights_published(self, result: TrainResult) -> None:
        """The trainer published what its policy made due before its step answered; the replicas
        follow by themselves, and the next batch may be dispatched against the new version."""
        self.fleet.after_step(result)

    def due_for_validation(self, result: TrainResult) -> bool:
        return self.validator is not None and self.validator.due(result.version)

    def due_for_final_validation(self) -> bool:
        """The run ended on weights no validation has seen yet: measure them,
        so the last validation figure is the model the final checkpoint holds."""
        v = self.validator
        if v is None or v.interval <= 0 or self.state.steps_done == 0:
            return False
        if self.errors.should_stop or self.state.stop_requested.is_set():
            return False
        return v.last_version != self.train_worker.version

    async def validate(self) -> dict[str, float]:
        assert self.validator is not None
        version = self.train_worker.version
        self.rollouts.pause()
        try:
            # Validation at version v is of the weights of version v: published (asked for if off
            # the schedule); its requests name it, so every replica that serves one holds it.
            await self.fleet.need(version, f"validation at version {version}")
            metrics = await self.validator.run(version)
        finally:
            self.rollouts.resume()
        self.metrics.write(self.train_worker.step, metrics)
        self._milestone("VALIDATION", version=version, metrics=metrics)
        log.info("validation at version %d: %s", version, metrics)
        return metrics

    def due_for_checkpoint(self, result: TrainResult) -> bool:
        interval = self.config.checkpoint.interval
        return interval > 0 and result.step % interval == 0

    def due_for_final_checkpoint(self) -> bool:
        if self.state.steps_done == 0 or self.errors.should_stop:
            return False
        if self.state.stop_requested.is_set():
            return self.state.checkpoint_on_stop
        return self.config.checkpoint.at_end

    async def checkpoint(self) -> str:
        if self.state.last_checkpoint_step == self.train_worker.step:
            return ""
        state = {"loader": self.loader.state_dict(), "step": self.train_worker.step, "version": self.train_worker.version}
        path = await self.trainer.save_checkpoint(json.dumps(state).encode())
        self.state.last_checkpoint_step = self.train_worker.step
        self.state.last_checkpoint_path = path
        self._milestone("CHECKPOINT", version=self.train_worker.version, path=path)
        log.info("checkpoint at step %d: %s", self.train_worker.step, path)
        return path

    # -- bookkeeping ----------------------------------------------------------
    def _milestone(self, kind: str, **details: Any) -> None:
        self.state.milestones.append({"kind": kind, "unix_ms": int(time.time() * 1000), "step": self.train_worker.step, **details})

    def record(self, batch: TrainBatch, result: TrainResult) -> dict[str, float]:
        m = self.step_metrics(batch, result)
        for hook in self.hooks.on_record:
            hook(batch, result, m)
        self.metrics.observe_staleness(batch.staleness())
        self.metrics.write(result.step, m)
        return m

    def step_metrics(self, batch: TrainBatch, result: TrainResult) -> dict[str, float]:
        t = now()
        start = self.tracker.started_at if self.tracker.started_at is not None else t
        wall = max(t - start, 1e-9)
        tw = self.train_worker
        m: dict[str, float] = {"step": float(result.step), "version": float(result.version)}
        m.update({f"train/{k}": float(v) for k, v in result.metrics.items()})
        rewards = [tr.reward for tr in batch.trajectories]
        m["rollout/reward_mean"] = statistics.fmean(rewards)
        m["rollout/reward_std"] = statistics.pstdev(rewards)
        scores: dict[str, list[float]] = defaultdict(list)
        for tr in batch.trajectories:
            for key, value in tr.scores.items():
                scores[key].append(value)
        m.update({f"rollout/{key}_mean": statistics.fmean(v) for key, v in scores.items() if key != "reward"})
        m["rollout/response_length_mean"] = statistics.fmean(sum(tr.response_mask) for tr in batch.trajectories)
        stale = batch.staleness()
        m["staleness/mean"], m["staleness/min"], m["staleness/max"] = statistics.fmean(stale), float(min(stale)), float(max(stale))
        self.state.sample_ages.observe(batch.target_version, batch.trajectories)
        m.update(self.state.sample_ages.metrics())
        self.state.stale_tokens_trained += batch.stale_tokens
        m.update(token_age_metrics(batch, self.state.stale_tokens_trained))
        # The sampler's kept sets the batch carried, and constrained tokens left out of the loss (their allowed
        # set too big to carry): per step and in every batch so far.
        self.state.sampler_counts.update(batch.sampler_counts)
        for name in ("kept_ids", "kept_size_only", "constrained", "constrained_excluded"):
            m[f"sampler/{name}_tokens"] = float(batch.sampler_counts[name])
            m[f"sampler/{name}_tokens_total"] = float(self.state.sampler_counts[name])
        # Samples whose weights changed while they were generated (partial rollouts).
        m["batch/mixed_version_samples"] = float(sum(tr.version_end != tr.version_start for tr in batch.trajectories))
        m["batch/samples"], m["batch/tokens"] = float(batch.size), float(batch.tokens)
        m["throughput/samples_per_second"] = tw.samples_trained / wall
        m["throughput/tokens_per_second"] = tw.tokens_trained / wall
        m["time/step_seconds"] = t - self.state.last_record_at
        self.state.last_record_at = t
        m["time/trainer_idle_fraction"] = self.trainer_idle_fraction()
        m.update(self.fleet.take_step_metrics())
        for module in ("trainer", "rollout"):
            busy = self.tracker.busy_seconds(module)
            m[f"time/busy_seconds/{module}"] = busy
            m[f"time/idle_seconds/{module}"] = max(0.0, wall - busy)
        instance = self.pool.instance(self.config.model.tag)
        m["pool/trajectory"] = float(len(instance.store))
        m["pool/train_batch"] = float(self.batches.qsize())
        m["rollout/in_flight"] = float(self.tracker.in_flight("rollout"))
        pooled = self.rollouts.stats["success"] * self.config.worker.group_size
        m["rollout/new_samples"], self.state.pooled_before = float(pooled - self.state.pooled_before), pooled
        for key in ("success", "fail", "re-rollout", "requeued", "failed_trajectories"):
            m[f"rollout/{key.replace('-', '_')}_total"] = float(self.rollouts.stats[key])
        if self.judge is not None:
            m.update(self.judge.metrics())
        if self.teacher is not None:
            m.update(self.teacher.metrics())
        for key, count in getattr(self.rollouts.worker, "stats", {}).items():  # a user's worker may keep none
            m[f"worker/{key}_total"] = float(count)
        m["dropped/stale"] = 0.0  # written every step, so a run that drops none says so
        for reason, count in self.processor.dropped.items():
            m[f"dropped/{reason}"] = float(count)
        for bucket, count in self.processor.stale_by_length.items():
            m[f"staleness/dropped_samples/{bucket}"] = float(count)
        if self.processor.paced:
            m["staleness/pace_waits"] = float(self.processor.pace_waits)
            m["staleness/pace_wait_seconds"] = self.processor.pace_wait_seconds
        return m

    def trainer_idle_fraction(self) -> float:
        """Idle share of the trainer's wall time since the first batch arrived
        (the pipeline fill before it is reported separately in the summary)."""
        if self.state.first_batch_at is None:
            return 1.0
        return self.tracker.idle_fraction("trainer", since=self.state.first_batch_at, busy_before=self.state.busy_at_first_batch)

    # -- stop -----------------------------------------------------------------
    async def stop(self) -> None:
        await self.rollouts.stop()
        if self.observer is not None:
            await self.observer.catch_up(timeout=5.0)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        if self.close_judge is not None:
            await self.close_judge()
        await self.rollouts.worker.close()
        self.metrics.close()

    def summary(self) -> RunSummary:
        t = now()
        wall = t - (self.tracker.started_at if self.tracker.started_at is not None else t)
        tw = self.train_worker
        return RunSummary(
            steps=self.state.steps_done,
            samples=tw.samples_trained,
            tokens=tw.tokens_trained,
            wall_seconds=wall,
            samples_per_second=tw.samples_trained / wall if wall > 0 else 0.0,
            trainer_idle_fraction=self.trainer_idle_fraction(),
            stop_reason=self.state.stop_reason or self.errors.stop_reason or "",
            final_version=tw.version,
            metrics=self.memory.latest(),
        )
