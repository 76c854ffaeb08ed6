"""A weight update as a transaction: the one way a new version reaches the
engine, whoever asked for it (`services.rollout.weights.arrival`).

Phases, each timed (`UpdateTimings`):
- transfer: the bytes fetched and staged (checked against the served model's
  names, dtypes and shapes and the version's identity) while generation goes
  on; the version's proof (its recorded identity with each tensor's digest,
  and the trainer's probe) is asked for;
- admit: in-flight requests end, finish or freeze by the pause mode (wait
  and abort close generation's gate first, keep once the engine froze at its
  step boundary);
- apply: the engine loads the staged tensors, within
  `updates.apply_timeout_seconds`;
- verify: what the engine measured of the weights it now holds, against the
  proof (`services.rollout.weights.measure`): VERIFIED only with every
  tensor covered;
- reopen.

Any failure before the gate closes leaves the old weights serving,
untouched. Any exception once it closed (admit, apply, verify, a probe that
fails, a cancellation) quarantines the replica before the gate can reopen:
the engine may hold weights that are no version, so the replica refuses
generation (UNAVAILABLE) until an update of it verifies; requests frozen in
place (keep) end ABORTed. An update that applied but could not be proven
(coverage incomplete) is UNVERIFIED and quarantined the same way. An apply
that outlives its deadline keeps its staged tensors until it has really
ended, and the next update waits for it first. Pause is what generation
feels: from the gate closing (wait, abort) or the engine freezing (keep) to
the reopen. Every outcome goes to the update observers (the synchronizer
link reports it: ReportUpdate).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from flywheel.codec.identity import VersionIdentity, version_digest
from flywheel.errors import DataLoss, DeadlineExceeded, FailedPrecondition
from flywheel.probe import ProbeBatch, ProbeCheck
from flywheel.synchronizer.client_types import VersionProof
from flywheel.synchronizer.types import UpdateCoverage, UpdatePhase, UpdateTimings
from services.rollout import metrics
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import Engine, LoadFaults, PauseMode, StagedWeights, engine_pulls_memory
from services.rollout.serving.core import RolloutCore
from services.rollout.weights.deltas import DeltaPolicy
from services.rollout.weights.measure import Verdict, judge, run_probe
from services.rollout.weights.staging import StagingBuffers

log = logging.getLogger(__name__)

Stage = Callable[[], Awaitable[StagedWeights]]
#: What the synchronizer recorded for the version being installed, asked for once it is staged (an
#: NCCL version is recorded only as its transfer commits); None: it has no record of it.
ProofSource = Callable[[], Awaitable[VersionProof | None]]


@dataclass
class UpdateResult:
    version: int
    pause_seconds: float
    nbytes: int
    aborted_request_ids: list[str]
    timings: UpdateTimings = field(default_factory=UpdateTimings)
    #: The identity measured on the resident weights (every tensor measured and the version's).
    identity: bytes = b""
    coverage: UpdateCoverage = field(default_factory=UpdateCoverage)


class UpdateFailed(DataLoss):
    """The engine does not hold the version after apply (it loaded a tensor wrong, the apply failed
    or did not finish in time): the replica is quarantined. DATA_LOSS: weights are not what was sent."""

    def __init__(self, message: str, phase: UpdatePhase, coverage: UpdateCoverage | None = None) -> None:
        super().__init__(message)
        self.phase = phase
        self.coverage = coverage or UpdateCoverage()


class UpdateUnverified(UpdateFailed):
    """Applied, and nothing measured contradicts the version, but the measurements did not cover every
    tensor: not proof. Quarantined like a failure."""


@dataclass(frozen=True)
class UpdateReport:
    """What became of one weight update that got past the version check."""

    #: The version the update tried to install.
    version: int
    #: The version serving after it: `version` on success, the old one when it failed before the
    #: gate closed, the new one (untrusted, quarantined) when it failed after.
    served: int
    #: Why it failed (a timeout, a cancelled call, bad weights); None on success.
    error: BaseException | None
    timings: UpdateTimings = field(default_factory=UpdateTimings)
    #: The phase that failed (None on success).
    failed_phase: UpdatePhase | None = None
    #: The identity computed from the digests measured on the resident weights (b"": not all measured).
    resident_identity: bytes = b""
    coverage: UpdateCoverage = field(default_factory=UpdateCoverage)

    @property
    def unverified(self) -> bool:
        return isinstance(self.error, UpdateUnverified)


#: Told of every update's outcome, whoever asked for it (called on the event loop; must not block or raise).
UpdateObserver = Callable[[UpdateReport], None]


class WeightUpdates:
    """Runs updates one at a time against the core's gate, and holds what lives from one to the next."""

    def __init__(self, core: RolloutCore, config: RolloutConfig) -> None:
        self.core, self.config = core, config
        self._lock = asyncio.Lock()  # one update at a time, staging included
        self.observers: list[UpdateObserver] = []
        #: MEMORY updates stage into these (held between updates; see services.rollout.weights.staging).
        self.staging = StagingBuffers(enabled=config.updates.reuse_staging)
        #: Whether MEMORY updates ask for a delta from the served weights (services.rollout.weights.deltas).
        self.deltas = DeltaPolicy(config.updates.delta_pulls)
        #: The identity its last verified update measured on the resident weights (b"": none verified yet).
        self.identity = b""
        #: An apply that outlived its deadline, with the staged weights it still reads.
        self._hung: tuple[asyncio.Future, StagedWeights] | None = None
        metrics.STAGING_HELD_BYTES.set_function(lambda: self.staging.held_bytes)

    async def run(self, version: int, stage: Stage, mode: PauseMode | None, timeout: float | None,
                  *, rewind: bool = False, proof: ProofSource | None = None) -> UpdateResult:
        """Transfers (fetch + check the bytes, and `proof`: the synchronizer's record of the version)
        within `timeout`, then admits, applies, verifies and reopens under the gate. Versions only go up, except for `rewind`: the synchronizer rewound
        the run's weights below the served ones, and any version of the new lineage replaces them
        (the same number may be other weights). A quarantined replica may install the same version
        again (its weights are not that version)."""
        engine, _ = self.core.require_engine()
        mode = mode or self.config.updates.default_pause_mode
        timeout = timeout or self.config.updates.timeout_seconds
        async with self._lock:
            if version <= engine.version and not rewind and not self.core.quarantine_reason:
                raise FailedPrecondition(f"version {version} is not newer than the served version {engine.version}")
            timings = _Timings()
            faults, delay = read_faults(self.config.updates.faults_file)
            try:
                started = time.monotonic()
                try:
                    staged = await asyncio.wait_for(self._transfer(engine, stage, version, proof, faults, timings), timeout)
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(
                        f"update to version {version} not staged within {timeout:g} s; still serving {engine.version}"
                    ) from None
                finally:
                    timings.transfer = time.monotonic() - started
                try:
                    result = await self._swap(engine, staged, mode, timings, faults, delay)
                finally:
                    await self._dispose(engine, staged)
            except BaseException as exc:
                metrics.WEIGHT_UPDATES.labels("unverified" if isinstance(exc, UpdateUnverified) else "failed").inc()
                phase = exc.phase if isinstance(exc, UpdateFailed) else (
                    UpdatePhase.TRANSFER if timings.admit is None else UpdatePhase.APPLY)
                log.warning("weight update failed", extra={"version": version, "serving": engine.version,
                                                           "phase": phase.name.lower(), "error": str(exc)})
                self._notify(UpdateReport(version, engine.version, exc, timings.freeze(), phase,
                                          timings.resident_identity, timings.coverage))
                raise
        self.core.lift_quarantine()
        self.identity = result.identity
        self._notify(UpdateReport(version, engine.version, None, result.timings, None, result.identity,
                                  result.coverage))
        metrics.WEIGHT_UPDATES.labels("committed").inc()
        metrics.WEIGHT_UPDATE_BYTES.inc(staged.nbytes)
        metrics.UPDATE_PAUSE.observe(result.pause_seconds)
        log.info("weights committed", extra={"version": version, "pause_seconds": round(result.pause_seconds, 4),
                                             "bytes": staged.nbytes, "mode": mode,
                                             "verify_seconds": round(result.timings.verify_seconds, 4),
                                             "coverage": result.coverage.describe()})
        return result

    def _notify(self, report: UpdateReport) -> None:
        for observer in self.observers:
            try:
                observer(report)
            except Exception:  # an observer's bug must not turn a committed update into an error
                log.exception("weight update observer failed", extra={"version": report.version})

    # -- transfer ----------------------------------------------------------------

    async def _transfer(self, engine: Engine, stage: Stage, version: int, proof: ProofSource | None,
                        faults: LoadFaults, timings: _Timings) -> StagedWeights:
        engine_pulls_memory.set(engine.pulls_memory)  # this task's context only
        staged = await stage()
        try:
            prepared = await engine.prepare_weights(staged, faults)
        except BaseException:
            await self._discard(engine, staged)
            raise
        timings.prepare = prepared.prepare_seconds
        if prepared is not staged:
            prepared.identity = prepared.identity or staged.identity
            prepared.probe = prepared.probe or staged.probe
            _release(staged)  # the engine made its own copy (e.g. shared memory for its worker)
        try:
            prepared.identity, prepared.probe = self._expected(version, prepared, await proof() if proof else None)
        except BaseException:
            await self._discard(engine, prepared)
            raise
        return prepared

    @staticmethod
    def _expected(version: int, staged: StagedWeights,
                  recorded: VersionProof | None) -> tuple[VersionIdentity | None, ProbeBatch | None]:
        """What the version is: the synchronizer's record when there is one (what the replica is judged
        against), else what was staged with it (a checkpoint manifest's, checked against its files, or
        the files' own). The two must agree; per-tensor digests must compose to the identity."""
        identity, probe = staged.identity, staged.probe
        if recorded is not None and recorded.identity.digest:
            if identity is not None and identity.digest != recorded.identity.digest:
                raise DataLoss(f"the weights staged for version {version} are not the version the synchronizer "
                               f"recorded: identity {identity.hex[:16]}, recorded {recorded.identity.hex[:16]}")
            tensors = recorded.identity.tensors or (identity.tensors if identity is not None else {})
            identity = VersionIdentity(recorded.identity.digest, tensors)
            probe = recorded.probe or probe
        if identity is not None and identity.tensors and version_digest(identity.tensors) != identity.digest:
            raise DataLoss(f"version {version}'s tensor digests do not make its identity {identity.hex[:16]}")
        return identity, probe

    # -- admit, apply, verify, reopen ----------------------------------------------

    async def _swap(self, engine: Engine, staged: StagedWeights, mode: PauseMode, timings: _Timings,
                    faults: LoadFaults, delay: float) -> UpdateResult:
        """Admit, apply and measure under the gate; then the probe, if the version has one, with
        generation going on and what it delivers held until the verdict (`RolloutCore.hold_deliveries`):
        the engine does not idle through a forward pass, and nothing made on unproven weights reaches
        a caller. Any failure quarantines the replica before a result of the new weights goes out."""
        core = self.core
        probing = staged.probe is not None and self.config.updates.probe and engine.supports_prompt_logprobs
        aborted: list[str] = []
        async with core.control:
            started = time.monotonic()
            core.updating = True
            # keep: requests go on arriving while the engine reaches its step boundary (they queue
            # there and are frozen with the others), so generation stops only once it froze. wait
            # and abort: the gate closes first (a drain would never end otherwise).
            if mode != "keep":
                core.close_gate()
            stopped = started
            try:
                try:
                    if not core.paused:
                        aborted = await core.pause_engine(mode)
                    core.close_gate()
                    timings.admit = time.monotonic() - started
                    if mode == "keep":
                        stopped = time.monotonic()
                    await self._apply(engine, staged, timings, faults, delay)
                    verdict = await self._measure(engine, staged, timings)
                    if not probing:
                        self._judged(staged, verdict)
                    else:
                        core.hold_deliveries()
                except BaseException as exc:
                    # Whatever failed here, the engine may hold weights that are no version: quarantined
                    # before the gate can reopen, so that no request waiting there goes on with them, and
                    # requests frozen in place (keep) end ABORTed, to be retried elsewhere.
                    probing = False
                    core.quarantine(f"update to version {staged.version}: {exc}")
                    with contextlib.suppress(Exception):
                        aborted += await core.pause_engine("abort")
                    raise
                finally:
                    reopened = time.monotonic()
                    if not core.paused:
                        await engine.resume()
                    timings.reopen = time.monotonic() - reopened
            finally:
                core.updating = False
                core.open_gate()
                timings.pause = time.monotonic() - stopped
        if probing:
            verdict = await self._probed(engine, staged, timings, verdict)
        return UpdateResult(engine.version, timings.pause, staged.nbytes, aborted, timings.freeze(),
                            verdict.resident_identity, verdict.coverage)

    async def _probed(self, engine: Engine, staged: StagedWeights, timings: _Timings, measured: Verdict) -> Verdict:
        """Scores the version's probe on the resident weights, generation going on and its results held;
        releases them on a verdict that proves the version, else quarantines and ends every request that
        made tokens meanwhile aborted, none of them delivered."""
        core, started = self.core, time.monotonic()
        try:
            if core.paused:  # an operator's Pause: the probe alone runs, and the engine pauses again after
                await engine.resume()
            try:
                tolerance = engine.probe_tolerance
                if self.config.updates.probe_tolerance is not None:  # the operator's bound, on the engine's statistic
                    tolerance = replace(tolerance, nats=self.config.updates.probe_tolerance)
                probe = await run_probe(engine, staged.probe, tolerance)
            finally:
                if core.paused:
                    await engine.pause("keep")
            verdict = judge(engine.weight_specs(), staged.identity, measured.measured, probe)
            timings.resident_identity, timings.coverage = verdict.resident_identity, verdict.coverage
            self._judged(staged, verdict)
        except BaseException as exc:
            core.quarantine(f"update to version {staged.version}: {exc}")
            core.release_deliveries(proven=False)
            async with core.control:
                with contextlib.suppress(Exception):
                    await core.pause_engine("abort")
                    if not core.paused:
                        await engine.resume()
            raise
        finally:
            timings.verify += time.monotonic() - started
        core.release_deliveries(proven=True)
        return verdict

    @staticmethod
    def _judged(staged: StagedWeights, verdict: Verdict) -> None:
        """Raises unless `verdict` proves the version."""
        if verdict.failed:
            raise UpdateFailed(verdict.describe_failure(staged.version), UpdatePhase.VERIFY, verdict.coverage)
        if not verdict.coverage.complete:
            raise UpdateUnverified(
                f"version {staged.version} applied but not proven: {verdict.coverage.describe()}"
                f"{'' if staged.identity and staged.identity.tensors else ' (the version has no per-tensor identity)'}",
                UpdatePhase.VERIFY, verdict.coverage)

    async def _apply(self, engine: Engine, staged: StagedWeights, timings: _Timings, faults: LoadFaults,
                     delay: float) -> None:
        """Loads the staged version, within `updates.apply_timeout_seconds`. An apply that outlives it
        fails the update (the replica is quarantined) and is waited for before the next one: two
        loads never run at once."""
        started = time.monotonic()
        limit = self.config.updates.apply_timeout_seconds
        try:
            if self._hung is not None and not self._hung[0].done():
                await asyncio.wait({self._hung[0]}, timeout=limit)
                if not self._hung[0].done():
                    raise UpdateFailed(f"an earlier apply is still running after {limit:g} s more",
                                       UpdatePhase.APPLY)
            apply = asyncio.ensure_future(self._load(engine, staged, faults, delay))
            try:
                await asyncio.wait_for(asyncio.shield(apply), limit)
            except asyncio.TimeoutError:
                self._hung = (apply, staged)
                raise UpdateFailed(f"apply did not finish within {limit:g} s (updates.apply_timeout_seconds)",
                                   UpdatePhase.APPLY) from None
        finally:
            timings.apply = time.monotonic() - started

    @staticmethod
    async def _load(engine: Engine, staged: StagedWeights, faults: LoadFaults, delay: float) -> None:
        if delay:
            log.warning("FAULT INJECTION: apply delayed", extra={"seconds": delay})
            await asyncio.sleep(delay)
        await engine.swap_weights(staged, faults)

    async def _measure(self, engine: Engine, staged: StagedWeights, timings: _Timings) -> Verdict:
        """What the engine measured of its resident weights (RESIDENT, RECEIVED), judged without a probe."""
        started = time.monotonic()
        try:
            measured = await engine.measure(list(engine.weight_specs()))
            verdict = judge(engine.weight_specs(), staged.identity, measured, ProbeCheck())
            timings.resident_identity, timings.coverage = verdict.resident_identity, verdict.coverage
            if verdict.wrong:  # a digest already contradicts the version: no probe needed to say so
                raise UpdateFailed(verdict.describe_failure(staged.version), UpdatePhase.VERIFY, verdict.coverage)
            return verdict
        finally:
            timings.verify = time.monotonic() - started

    # -- after ---------------------------------------------------------------------

    async def _dispose(self, engine: Engine, staged: StagedWeights) -> None:
        """Releases what staging made, once nothing reads it: an apply that outlived its deadline
        still does, and its staged weights go back only when it ends."""
        if self._hung is not None and self._hung[1] is staged and not self._hung[0].done():
            hung = self._hung[0]
            log.warning("a late apply still reads the staged weights; released once it ends",
                        extra={"version": staged.version})
            hung.add_done_callback(lambda _: asyncio.ensure_future(self._discard(engine, staged)))
            return
        await self._discard(engine, staged)

    @staticmethod
    async def _discard(engine: Engine, staged: StagedWeights) -> None:
        try:
            await engine.discard_weights(staged)
        finally:
            _release(staged)


@dataclass
class _Timings:
    """An update's phase durations as they are measured (None: not reached), and what verify found."""

    transfer: float = 0.0
    prepare: float = 0.0
    admit: float | None = None
    apply: float = 0.0
    verify: float = 0.0
    reopen: float = 0.0
    pause: float = 0.0
    resident_identity: bytes = b""
    coverage: UpdateCoverage = field(default_factory=UpdateCoverage)

    def freeze(self) -> UpdateTimings:
        return UpdateTimings(admit_seconds=self.admit or 0.0, transfer_seconds=self.transfer,
                             apply_seconds=self.apply, verify_seconds=self.verify, reopen_seconds=self.reopen,
                             pause_seconds=self.pause, prepare_seconds=self.prepare)


#: The faults file's keys -> LoadFaults fields ("corrupt_after_apply": the key's earlier name).
_FAULT_KEYS = {"corrupt_readable": "corrupt_readable", "corrupt_after_apply": "corrupt_readable",
               "scale_linear": "scale_linear", "swap_same_shaped": "swap_same_shaped", "skip_one": "skip_one",
               "raise_halfway": "raise_halfway"}


def read_faults(path: Path | None) -> tuple[LoadFaults, float]:
    """The fault-injection file's faults and apply delay (seconds) while it exists (none otherwise, or unset)."""
    if path is None or not path.exists():
        return LoadFaults(), 0.0
    try:
        faults = json.loads(path.read_text() or "{}")
    except (OSError, ValueError) as exc:
        log.warning("unreadable faults file; no fault injected", extra={"path": str(path), "error": str(exc)})
        return LoadFaults(), 0.0
    if not isinstance(faults, dict):
        return LoadFaults(), 0.0
    fields = {_FAULT_KEYS[k]: v for k, v in faults.items() if k in _FAULT_KEYS}
    fields["scale_linear"] = float(fields.get("scale_linear") or 0.0)
    return LoadFaults(**{k: v if k == "scale_linear" else bool(v) for k, v in fields.items()}), \
        float(faults.get("apply_delay_seconds") or 0.0)


def _release(staged: StagedWeights) -> None:
    if staged.release is not None:
        release, staged.release = staged.release, None
        release()
