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
- An update is a transaction in phases (each timed, `UpdateTimings`):
  transfer (the bytes staged and verified while generation goes on), admit
  (in-flight requests end, finish or freeze by the pause mode; wait and
  abort close the gate first, keep once the engine froze at its step
  boundary), apply (the engine loads the staged tensors, within
  `updates.apply_timeout_seconds`), verify (the identity of the weights now
  resident is measured and compared with the version's) and reopen. Any
  failure before apply leaves the old weights serving. A failure in apply or
  verify leaves the engine holding weights that are not the version: the
  replica is then quarantined, refusing generation (UNAVAILABLE) until an
  update of it verifies. Pause is what generation feels: from the gate
  closing (wait, abort) or the engine freezing (keep) to the reopen. Every
  outcome goes to the update observers (the synchronizer link reports it:
  ReportUpdate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.codec.identity import VersionIdentity, version_digest
from flywheel.errors import DataLoss, DeadlineExceeded, FailedPrecondition, ResourceExhausted, Unavailable
from flywheel.synchronizer.types import UpdatePhase, UpdateTimings
from services.rollout import metrics
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import (
    Delta, Engine, PauseMode, SampleOutput, SamplingSpec, StagedWeights, engine_pulls_memory,
)
from services.rollout.serving.prompts import PromptInput, ResolvedPrompt, resolve
from services.rollout.weights.deltas import DeltaPolicy
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
    timings: UpdateTimings = field(default_factory=UpdateTimings)
    #: The identity the resident weights were verified to have.
    identity: bytes = b""


class UpdateFailed(DataLoss):
    """The engine does not hold the version after apply (it loaded a tensor wrong, or apply did
    not finish in time): the replica is quarantined. DATA_LOSS: weights are not what was sent."""

    def __init__(self, message: str, phase: UpdatePhase) -> None:
        super().__init__(message)
        self.phase = phase


@dataclass(frozen=True)
class UpdateReport:
    """What became of one weight update that got past the version check."""

    #: The version the update tried to install.
    version: int
    #: The version serving after it: `version` on success, the old one otherwise (or the new one,
    #: unverified, when apply or verification failed).
    served: int
    #: Why it failed (a timeout, a cancelled call, bad weights); None on success.
    error: BaseException | None
    timings: UpdateTimings = field(default_factory=UpdateTimings)
    #: The phase that failed (None on success).
    failed_phase: UpdatePhase | None = None
    #: The identity measured on the resident weights (b"": not measured).
    resident_identity: bytes = b""


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
    #: Why it takes no traffic ("" when it serves).
    quarantine_reason: str = ""


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
        #: Whether MEMORY updates ask for a delta from the served weights (services.rollout.weights.deltas).
        self.deltas = DeltaPolicy(config.updates.delta_pulls)
        #: Why the replica takes no traffic (its last update failed in apply or verify); "" when it serves.
        self.quarantine_reason = ""
        #: The identity of the weights its last verified update installed (b"": the base weights, unmeasured).
        self.identity = b""
        #: An apply that outlived its deadline and may still be running in the engine.
        self._hung_apply: asyncio.Future | None = None
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
                # The update it waited for may have failed: the engine then holds weights that are
                # not any version, and the replica is quarantined.
                self._refuse_if_quarantined()
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

    def _refuse_if_quarantined(self) -> None:
        if self.quarantine_reason:
            raise Unavailable(f"this rollout is quarantined and serves nothing until a weight update verifies: "
                              f"{self.quarantine_reason}")

    async def _weights_ready(self, run_step: int, min_version: int) -> None:
        self._refuse_if_quarantined()
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
        spec = self.require_engine()[0].resolve(spec)
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
        spec = self.require_engine()[0].resolve(spec)
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
            quarantine_reason=self.quarantine_reason,
        )

    # -- weight updates --------------------------------------------------------

    async def update_weights(
        self, version: int, stage: Callable[[], Awaitable[StagedWeights]], mode: PauseMode | None, timeout: float | None,
        *, rewind: bool = False,
    ) -> UpdateOutcome:
        """Transfers (fetch + verify the bytes) within `timeout`, then admits, applies, verifies and
        reopens under the gate. Versions only go up, except for `rewind`: the synchronizer rewound
        the run's weights below the served ones, and any version of the new lineage replaces them
        (the same number may be other weights). A quarantined replica may install the same version
        again (its weights are not that version)."""
        engine, _ = self.require_engine()
        mode = mode or self.config.updates.default_pause_mode
        timeout = timeout or self.config.updates.timeout_seconds
        async with self._update:
            if version <= engine.version and not rewind and not self.quarantine_reason:
                raise FailedPrecondition(f"version {version} is not newer than the served version {engine.version}")
            timings = _Timings()
            try:
                started = time.monotonic()
                try:
                    staged = await asyncio.wait_for(self._stage(engine, stage), timeout)
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(
                        f"update to version {version} not staged within {timeout:g} s; still serving {engine.version}"
                    ) from None
                finally:
                    timings.transfer = time.monotonic() - started
                try:
                    outcome = await self._swap(engine, staged, mode, timings)
                finally:
                    await engine.discard_weights(staged)
                    _release(staged)
            except BaseException as exc:
                metrics.WEIGHT_UPDATES.labels("failed").inc()
                phase = exc.phase if isinstance(exc, UpdateFailed) else (
                    UpdatePhase.TRANSFER if timings.admit is None else UpdatePhase.APPLY)
                log.warning("weight update failed", extra={"version": version, "serving": engine.version,
                                                           "phase": phase.name.lower(), "error": str(exc)})
                self._notify(UpdateReport(version, engine.version, exc, timings.freeze(), phase,
                                          timings.resident_identity))
                raise
        self.quarantine_reason = ""
        self.identity = outcome.identity
        self._notify(UpdateReport(version, engine.version, None, outcome.timings, None, outcome.identity))
        metrics.WEIGHT_UPDATES.labels("committed").inc()
        metrics.WEIGHT_UPDATE_BYTES.inc(staged.nbytes)
        metrics.UPDATE_PAUSE.observe(outcome.pause_seconds)
        log.info("weights committed", extra={"version": version, "pause_seconds": round(outcome.pause_seconds, 4),
                                             "bytes": staged.nbytes, "mode": mode,
                                             "verify_seconds": round(outcome.timings.verify_seconds, 4)})
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
            if prepared.identity is None:
                prepared.identity = staged.identity
            _release(staged)  # the engine made its own copy (e.g. shared memory for its worker)
        return prepared

    async def _swap(self, engine: Engine, staged: StagedWeights, mode: PauseMode, timings: _Timings) -> UpdateOutcome:
        async with self._control:
            started = time.monotonic()
            self._updating = True
            # keep: requests go on arriving while the engine reaches its step boundary (they queue
            # there and are frozen with the others), so generation stops only once it froze. wait
            # and abort: the gate closes first (a drain would never end otherwise).
            if mode != "keep":
                self._open.clear()
            aborted: list[str] = []
            stopped = started
            try:
                if not self._paused:
                    aborted = await self._pause_engine(mode)
                self._open.clear()
                timings.admit = time.monotonic() - started
                if mode == "keep":
                    stopped = time.monotonic()
                try:
                    await self._apply(engine, staged, timings)
                    identity = await self._verify(engine, staged, timings)
                except UpdateFailed as exc:
                    # The engine holds weights that are not the version: quarantined before the gate
                    # reopens, so that no request waiting there goes on with them, and requests frozen
                    # in place (keep) end ABORTed, to be retried elsewhere.
                    self.quarantine_reason = f"update to version {staged.version}: {exc}"
                    aborted += await self._pause_engine("abort")
                    raise
                finally:
                    reopened = time.monotonic()
                    if not self._paused:
                        await engine.resume()
                    timings.reopen = time.monotonic() - reopened
            finally:
                self._updating = False
                if not self._paused:
                    self._open.set()
                timings.pause = time.monotonic() - stopped
            return UpdateOutcome(engine.version, timings.pause, staged.nbytes, aborted, timings.freeze(), identity)

    async def _apply(self, engine: Engine, staged: StagedWeights, timings: _Timings) -> None:
        """Loads the staged version, within `updates.apply_timeout_seconds`. An apply that outlives it
        fails the update (the replica is quarantined) and is awaited again before the next one: two
        loads never run at once."""
        started = time.monotonic()
        limit = self.config.updates.apply_timeout_seconds
        try:
            if self._hung_apply is not None and not self._hung_apply.done():
                await asyncio.wait_for(asyncio.shield(self._hung_apply), limit)
            faults = read_faults(self.config.updates.faults_file)
            apply = asyncio.ensure_future(self._load(engine, staged, faults))
            try:
                await asyncio.wait_for(asyncio.shield(apply), limit)
            except asyncio.TimeoutError:
                self._hung_apply = apply
                raise UpdateFailed(f"apply did not finish within {limit:g} s (updates.apply_timeout_seconds)",
                                   UpdatePhase.APPLY) from None
        except asyncio.TimeoutError:
            raise UpdateFailed(f"an earlier apply is still running after {limit:g} s more", UpdatePhase.APPLY) from None
        finally:
            timings.apply = time.monotonic() - started

    async def _load(self, engine: Engine, staged: StagedWeights, faults: dict) -> None:
        if faults.get("apply_delay_seconds"):
            log.warning("FAULT INJECTION: apply delayed", extra={"seconds": faults["apply_delay_seconds"]})
            await asyncio.sleep(float(faults["apply_delay_seconds"]))
        await engine.swap_weights(staged)
        if faults.get("corrupt_after_apply"):
            name = await engine.corrupt_one_element()
            log.warning("FAULT INJECTION: one element of a loaded tensor changed", extra={"tensor": name})

    async def _verify(self, engine: Engine, staged: StagedWeights, timings: _Timings) -> bytes:
        """The identity of the resident weights, compared with the version's; UpdateFailed (VERIFY)
        when they differ. Tensors the engine cannot read back as the checkpoint holds them (a dtype
        it converted to, a layout it repacked into) are checked only as staged."""
        started = time.monotonic()
        try:
            expected = staged.identity
            names = list(expected.tensors) if expected and expected.tensors else list(engine.weight_specs())
            resident = await engine.resident_digests(names)
            if not resident:
                return expected.digest if expected else b""
            timings.resident_identity = version_digest(resident) if len(resident) == len(names) else b""
            if expected is None:
                return timings.resident_identity
            if expected.tensors:
                measured = VersionIdentity(b"", resident)
                wrong = [n for n in resident if resident[n] != expected.tensors.get(n)]
                if wrong:
                    raise UpdateFailed(
                        f"the resident weights are not version {staged.version}: "
                        f"{measured.describe_mismatch(VersionIdentity(b'', {n: expected.tensors[n] for n in resident}))}",
                        UpdatePhase.VERIFY)
            elif len(resident) == len(names) and timings.resident_identity != expected.digest:
                raise UpdateFailed(
                    f"the resident weights' identity {timings.resident_identity.hex()[:16]} is not version "
                    f"{staged.version}'s {expected.hex[:16]}", UpdatePhase.VERIFY)
            if len(resident) < len(names):
                log.info("verified the tensors the engine can read back; the others as staged",
                         extra={"version": staged.version, "resident": len(resident), "tensors": len(names)})
            return expected.digest
        finally:
            timings.verify = time.monotonic() - started


@dataclass
class _Timings:
    """An update's phase durations as they are measured (None: not reached)."""

    transfer: float = 0.0
    admit: float | None = None
    apply: float = 0.0
    verify: float = 0.0
    reopen: float = 0.0
    pause: float = 0.0
    resident_identity: bytes = b""

    def freeze(self) -> UpdateTimings:
        return UpdateTimings(admit_seconds=self.admit or 0.0, transfer_seconds=self.transfer,
                             apply_seconds=self.apply, verify_seconds=self.verify, reopen_seconds=self.reopen,
                             pause_seconds=self.pause)


def read_faults(path: Path | None) -> dict:
    """The fault-injection file's keys while it exists ({} otherwise, or unset)."""
    if path is None or not path.exists():
        return {}
    try:
        faults = json.loads(path.read_text() or "{}")
    except (OSError, ValueError) as exc:
        log.warning("unreadable faults file; no fault injected", extra={"path": str(path), "error": str(exc)})
        return {}
    return faults if isinstance(faults, dict) else {}


def _release(staged: StagedWeights) -> None:
    if staged.release is not None:
        release, staged.release = staged.release, None
        release()
