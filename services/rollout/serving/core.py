"""The rollout service's domain core: admission, the update gate, pause modes
and weight versions, on top of one engine. Both transports (gRPC servicer and
OpenAI HTTP) call this and nothing else.

Invariants:
- A request waits at the gate while an update (or a Pause) is in progress and
  reaches the engine only when it is open, so no request sees a half-updated
  model; the engine stamps every sample with the version of its first and
  last token.
- At most `limits.max_pending_requests` samples are admitted at once (waiting
  at the gate or in the engine); past that, QueueFull (RESOURCE_EXHAUSTED/429).
- An update is staged and verified before the gate closes; any failure
  before the swap leaves the old weights serving, and the version changes
  exactly when the swap succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from flywheel.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted
from services.rollout import metrics
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import (
    Delta, Engine, PauseMode, SampleOutput, SamplingSpec, StagedWeights, engine_pulls_memory,
)
from services.rollout.serving.prompts import PromptInput, ResolvedPrompt, resolve
from services.rollout.weights.staging import StagingBuffers
from services.rollout.serving.text import TextCodec

log = logging.getLogger(__name__)

# How long Pause(abort) waits for aborted requests to report back.
_ABORT_SETTLE_SECONDS = 2.0


class QueueFull(ResourceExhausted):
    """Too much work admitted; carries the retry hint for clients."""

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


@dataclass
class PromptOutput:
    request_id: str
    prompt_ids: list[int]
    samples: list[SampleOutput]


@dataclass
class UpdateOutcome:
    version: int
    pause_seconds: float
    nbytes: int
    aborted_request_ids: list[str]


@dataclass(frozen=True)
class UpdateReport:
    """What became of one weight update that got past the version check."""

    #: The version the update tried to install.
    version: int
    #: The version serving after it: `version` on success, the old one otherwise.
    served: int
    #: Why it failed (a timeout, a cancelled call, bad weights); None on success.
    error: BaseException | None


#: Told of every update's outcome, whoever asked for it (called on the event
#: loop; must not block or raise).
UpdateObserver = Callable[[UpdateReport], None]


@dataclass
class Status:
    model_name: str
    engine: str
    version: int
    running: int
    waiting: int
    kv_cache_usage: float
    paused: bool
    updating: bool
    max_model_len: int


class Reservation:
    """Admitted samples; released exactly once."""

    def __init__(self, core: RolloutCore, samples: int) -> None:
        self._core: RolloutCore | None = core
        self.samples = samples

    def release(self) -> None:
        if self._core is not None:
            self._core._pending -= self.samples
            self._core = None


@dataclass(eq=False)
class _Flight:
    request_id: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False


class RolloutCore:
    def __init__(self, config: RolloutConfig, engine: Engine | None, codec: TextCodec | None, model_name: str) -> None:
        self.config = config
        self.engine = engine
        self.codec = codec
        self.model_name = model_name
        self._pending = 0
        self._at_gate = 0
        self._open = asyncio.Event()
        self._open.set()
        self._paused = False
        self._updating = False
        self._control = asyncio.Lock()  # Pause / Resume / the swap phase of updates
        self._update = asyncio.Lock()  # one update at a time, staging included
        self._flights: set[_Flight] = set()
        self.update_observers: list[UpdateObserver] = []
        #: Set by the synchronizer link: waits until a generation of (run_step,
        #: min_version) may run on the served weights (services.rollout.weights.follower).
        self.weights_gate: Callable[[int, int], Awaitable[None]] | None = None
        #: MEMORY updates stage into these (held between updates; see services.rollout.weights.staging).
        self.staging = StagingBuffers(enabled=config.updates.reuse_staging)
        metrics.STAGING_HELD_BYTES.set_function(lambda: self.staging.held_bytes)
        metrics.WEIGHT_VERSION.set_function(lambda: self.engine.version if self.engine else 0)
        metrics.REQUESTS_RUNNING.set_function(lambda: self.engine.load().running if self.engine else 0)
        metrics.REQUESTS_WAITING.set_function(lambda: (self.engine.load().waiting if self.engine else 0) + self._at_gate)

    def attach(self, engine: Engine, codec: TextCodec) -> None:
        """Starts serving a started engine (called once, from the service's startup)."""
        self.engine, self.codec = engine, codec

    # -- prompts ---------------------------------------------------------------

    def require_engine(self) -> tuple[Engine, TextCodec]:
        if self.engine is None or self.codec is None:
            raise FailedPrecondition("no model is loaded (start the service with --engine.model-path)")
        return self.engine, self.codec

    def resolve(self, prompt: PromptInput, field: str, request_id: str = "") -> ResolvedPrompt:
        engine, codec = self.require_engine()
        return resolve(prompt, codec, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                       field=field, request_id=request_id)

    # -- admission and the gate ------------------------------------------------

    def reserve(self, samples: int) -> Reservation:
        """Admits `samples` samples now or raises QueueFull; release() the result when done."""
        limit = self.config.limits.max_pending_requests
        if self._pending + samples > limit:
            metrics.REJECTED_REQUESTS.labels("queue_full").inc()
            # Spread over [hint, 2 x hint]: clients refused together, told the same delay, would all
            # come back at once and be refused together again (bench/load.py: p99 13 s without it).
            retry = self.config.limits.retry_after_seconds * random.uniform(1.0, 2.0)
            raise QueueFull(
                f"rollout queue is full ({self._pending} of {limit} samples pending, this request needs {samples}); "
                f"retry after {retry:.1f} s", retry)
        self._pending += samples
        return Reservation(self, samples)

    @asynccontextmanager
    async def _admitted(self, samples: int, reservation: Reservation | None) -> AsyncIterator[None]:
        reservation = reservation or self.reserve(samples)
        try:
            if not self._open.is_set():
                self._at_gate += 1
                try:
                    await self._open.wait()
                finally:
                    self._at_gate -= 1
            yield
        finally:
            reservation.release()

    async def _run_one(self, prompt: ResolvedPrompt, spec: SamplingSpec, stream: bool) -> AsyncIterator[list[Delta]]:
        engine = self.engine
        assert engine is not None
        flight = _Flight(prompt.request_id)
        self._flights.add(flight)
        metrics.PROMPT_TOKENS.inc(len(prompt.ids))
        try:
            engine_id = f"{prompt.request_id}#{uuid.uuid4().hex[:12]}"
            async for deltas in engine.generate(engine_id, prompt.ids, spec, stream=stream):
                for d in deltas:
                    if d.final is not None:
                        metrics.GENERATED_TOKENS.inc(len(d.final.token_ids))
                        flight.aborted |= d.final.finish_reason == "abort"
                yield deltas
        finally:
            self._flights.discard(flight)
            flight.done.set()

    async def _weights_ready(self, run_step: int, min_version: int) -> None:
        if self.weights_gate is not None:
            await self.weights_gate(run_step, min_version)
        elif min_version > self.status().version:
            raise FailedPrecondition(
                f"min_weight_version {min_version}: this rollout serves version {self.status().version} and has no "
                "synchronizer to move to a newer one (set synchronizer.address)"
            )

    async def generate(
        self, prompts: list[ResolvedPrompt], spec: SamplingSpec, reservation: Reservation | None = None,
        *, run_step: int = 0, min_version: int = 0,
    ) -> list[PromptOutput]:
        """All prompts' samples, in order; aborted samples come back with finish reason "abort".

        `run_step`/`min_version`: the weights the generation must wait for (see follower.py)."""
        self.require_engine()
        await self._weights_ready(run_step, min_version)
        prompts = [p if p.request_id else ResolvedPrompt(p.ids, f"gen-{uuid.uuid4().hex[:16]}", p.tools) for p in prompts]
        async with self._admitted(len(prompts) * spec.n, reservation):

            async def one(prompt: ResolvedPrompt) -> PromptOutput:
                finals: list[SampleOutput] = []
                async for deltas in self._run_one(prompt, spec, stream=False):
                    finals += [d.final for d in deltas if d.final is not None]
                return PromptOutput(prompt.request_id, prompt.ids, sorted(finals, key=lambda s: s.index))

            tasks = [asyncio.ensure_future(one(p)) for p in prompts]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                # One prompt failed: the others must not run on unaccounted.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    async def generate_stream(
        self, prompt: ResolvedPrompt, spec: SamplingSpec, reservation: Reservation | None = None,
        *, run_step: int = 0, min_version: int = 0,
    ) -> AsyncIterator[list[Delta]]:
        """Deltas of one prompt's samples as they come (`reserve` first to fail before streaming)."""
        self.require_engine()
        await self._weights_ready(run_step, min_version)
        if not prompt.request_id:
            prompt = ResolvedPrompt(prompt.ids, f"gen-{uuid.uuid4().hex[:16]}", prompt.tools)
        async with self._admitted(spec.n, reservation):
            async for deltas in self._run_one(prompt, spec, stream=True):
                yield deltas

    # -- pause, resume, status -------------------------------------------------

    async def _pause_engine(self, mode: PauseMode) -> list[str]:
        """Pauses the engine; for abort, the request ids that ended aborted."""
        engine = self.engine
        assert engine is not None
        snapshot = list(self._flights)
        await engine.pause(mode)
        if mode != "abort" or not snapshot:
            return []
        # A request that raced past the gate may sit queued in the engine, not
        # aborted: it is not waited for beyond the settle time, nor reported.
        await asyncio.wait([asyncio.ensure_future(f.done.wait()) for f in snapshot], timeout=_ABORT_SETTLE_SECONDS)
        return sorted({f.request_id for f in snapshot if f.done.is_set() and f.aborted})

    async def pause(self, mode: PauseMode) -> tuple[list[str], int]:
        engine, _ = self.require_engine()
        async with self._control:
            if self._paused:
                return [], engine.version
            self._open.clear()
            self._paused = True
            try:
                aborted = await self._pause_engine(mode)
            except BaseException:
                self._paused = False
                self._open.set()
                raise
            return aborted, engine.version

    async def resume(self) -> int:
        engine, _ = self.require_engine()
        async with self._control:
            if self._paused:
                await engine.resume()
                self._paused = False
                self._open.set()
            return engine.version

    def status(self) -> Status:
        engine = self.engine
        load = engine.load() if engine else None
        return Status(
            model_name=self.model_name,
            engine=engine.kind if engine else "none",
            version=engine.version if engine else self.config.engine.initial_version,
            running=load.running if load else 0,
            waiting=(load.waiting if load else 0) + self._at_gate,
            kv_cache_usage=load.kv_cache_usage if load else 0.0,
            paused=self._paused,
            updating=self._updating,
            max_model_len=engine.max_model_len if engine else 0,
        )

    # -- weight updates --------------------------------------------------------

    async def update_weights(
        self, version: int, stage: Callable[[], Awaitable[StagedWeights]], mode: PauseMode | None, timeout: float | None,
        *, rewind: bool = False,
    ) -> UpdateOutcome:
        """Stages (fetch + verify) within `timeout`, then swaps under the gate. Versions only go
        up, except for `rewind`: the synchronizer rewound the run's weights below the served ones,
        and any version of the new lineage replaces them (the same number may be other weights)."""
        engine, _ = self.require_engine()
        mode = mode or self.config.updates.default_pause_mode
        timeout = timeout or self.config.updates.timeout_seconds
        async with self._update:
            if version <= engine.version and not rewind:
                raise FailedPrecondition(f"version {version} is not newer than the served version {engine.version}")
            try:
                try:
                    staged = await asyncio.wait_for(self._stage(engine, stage), timeout)
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(
                        f"update to version {version} not staged within {timeout:g} s; still serving {engine.version}"
                    ) from None
                try:
                    outcome = await self._swap(engine, staged, mode)
                finally:
                    await engine.discard_weights(staged)
                    _release(staged)
            except BaseException as exc:
                metrics.WEIGHT_UPDATES.labels("failed").inc()
                log.warning("weight update failed", extra={"version": version, "serving": engine.version, "error": str(exc)})
                self._notify(UpdateReport(version, engine.version, exc))
                raise
        self._notify(UpdateReport(version, engine.version, None))
        metrics.WEIGHT_UPDATES.labels("committed").inc()
        metrics.WEIGHT_UPDATE_BYTES.inc(staged.nbytes)
        metrics.UPDATE_PAUSE.observe(outcome.pause_seconds)
        log.info("weights committed", extra={"version": version, "pause_seconds": round(outcome.pause_seconds, 4),
                                             "bytes": staged.nbytes, "mode": mode})
        return outcome

    def _notify(self, report: UpdateReport) -> None:
        for observer in self.update_observers:
            try:
                observer(report)
            except Exception:  # an observer's bug must not turn a committed update into an error
                log.exception("weight update observer failed", extra={"version": report.version})

    async def _stage(self, engine: Engine, stage: Callable[[], Awaitable[StagedWeights]]) -> StagedWeights:
        engine_pulls_memory.set(engine.pulls_memory)  # this task's context only
        staged = await stage()
        try:
            prepared = await engine.prepare_weights(staged)
        except BaseException:
            await engine.discard_weights(staged)
            _release(staged)
            raise
        if prepared is not staged:
            _release(staged)  # the engine made its own copy (e.g. shared memory for its worker)
        return prepared

    async def _swap(self, engine: Engine, staged: StagedWeights, mode: PauseMode) -> UpdateOutcome:
        async with self._control:
            started = time.monotonic()
            self._updating = True
            self._open.clear()
            aborted: list[str] = []
            try:
                if not self._paused:
                    aborted = await self._pause_engine(mode)
                try:
                    await engine.swap_weights(staged)
                finally:
                    if not self._paused:
                        await engine.resume()
            finally:
                self._updating = False
                if not self._paused:
                    self._open.set()
            return UpdateOutcome(engine.version, time.monotonic() - started, staged.nbytes, aborted)


def _release(staged: StagedWeights) -> None:
    if staged.release is not None:
        release, staged.release = staged.release, None
        release()
