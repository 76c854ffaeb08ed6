"""A simulated rollout replica: generations of drawn durations, following the synchronizer's versions by
its own run steps, with the faults a test sets on it."""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.common.provenance import VersionSpan, spans_of
from flywheel.errors import Aborted, FailedPrecondition, Unavailable
from flywheel.synchronizer.policy import required_version
from flywheel.synchronizer.types import Role, UpdateCoverage, UpdateOutcome, UpdatePhase, UpdateRecord, UpdateTimings
from services.controller.domain import MIN_WEIGHT_VERSION, RUN_STEP, FinishReason, Generation, PromptInput, SamplingSpec
from services.controller.testing.simulated.clock import Draw, constant
from services.controller.testing.simulated.synchronizer import SimulatedSynchronizer


def _default_text(prompt: PromptInput, rng: random.Random) -> str:
    return f"The answer is \\boxed{{{rng.randint(0, 3)}}}"


@dataclass
class SimulatedRolloutEngine:
    name: str = "sim-rollout-0"
    #: Time of one Generate call (all n samples of a prompt finish together).
    gen_time: Draw = field(default_factory=lambda: constant(0.01))
    #: Time of one weight update (transfer and apply; generation pauses only for the apply).
    update_time: Draw = field(default_factory=lambda: constant(0.0))
    response_tokens: Callable[[random.Random], int] = lambda rng: rng.randint(4, 32)
    text: Callable[[PromptInput, random.Random], str] = _default_text
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    version: int = 0
    #: Probability that a request fails with Unavailable (failover tests).
    unavailable_probability: float = 0.0
    #: Probability that a completion comes back ABORTed (re-rollout tests).
    abort_probability: float = 0.0
    down: bool = False
    generated: list[Generation] = field(default_factory=list)
    #: A fault: version -> whether its update loads a tensor wrong (verification then fails).
    fail_updates: Callable[[int], bool] = lambda version: False
    #: What its verify phase measures of a version (incomplete: the update is UNVERIFIED).
    measures: Callable[[int], UpdateCoverage] = lambda version: UpdateCoverage(8, 8 << 20, 8, 8 << 20)
    #: Every update it made, as reported.
    updates: list[UpdateRecord] = field(default_factory=list)
    synchronizer: SimulatedSynchronizer | None = None
    #: Run steps completed (the newest run_step seen, minus one); step -> the version NeedSync named.
    steps: int = 0
    due: dict[int, int] = field(default_factory=dict)
    #: Its last update failed (the synchronizer quarantines it), at version `_failed`.
    quarantined: bool = False
    _failed: int = 0
    _target: int = 0
    _follower: asyncio.Task | None = None
    _moved: asyncio.Event | None = None
    _updating: asyncio.Event | None = None
    _aborts: set[asyncio.Event] = field(default_factory=set)
    _in_flight: int = 0
    #: (loop time, version) of each version it served, in order: what spans its generations' tokens.
    _served: list[tuple[float, int]] = field(default_factory=list)

    def attach(self, synchronizer: SimulatedSynchronizer) -> None:
        self.synchronizer = synchronizer
        synchronizer.register(Role.ROLLOUT, self.name)

    def _ids(self, text: str, n: int | None = None) -> list[int]:
        seed = zlib.crc32(text.encode())
        count = n if n is not None else max(1, len(text) // 4)
        return [1 + (seed + 7919 * i) % 997 for i in range(count)]

    async def tokenize(self, *, text=None, messages=None, add_generation_prompt: bool = True) -> list[int]:
        if self.down:
            raise Unavailable(f"{self.name} is down")
        body = text if text is not None else "".join(f"{m['role']}:{m['content']}" for m in messages or [])
        return self._ids(body)

    # -- following the synchronizer ----------------------------------------------
    async def _before_generate(self, run_step: int, min_version: int) -> None:
        """What the real follower does before a generation (services/rollout/weights/follower.py)."""
        sync = self.synchronizer
        if sync is None:
            return
        due = 0
        if run_step > 0:
            step = run_step - 1
            if step > self.steps:
                self.steps = step
                decision = sync.need_sync(self.name, step)
                if decision.need_sync:
                    self.due[step] = decision.version
                    self._aim(decision.version)
            due = self.due.get(step, 0)
        need = max(min_version, required_version(sync.policy, run_step, due))
        if need <= self.version:
            return
        self._aim(need)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + sync.policy.timeout_seconds
        while self.version < need:
            if loop.time() >= deadline:
                raise Aborted(f"{self.name} serves version {self.version}; this generation needs {need}")
            moved = self._moved_event()
            try:
                await asyncio.wait_for(moved.wait(), deadline - loop.time())
            except TimeoutError:
                pass

    def _moved_event(self) -> asyncio.Event:
        if self._moved is None:
            self._moved = asyncio.Event()
        return self._moved

    def _aim(self, version: int) -> None:
        self._target = max(self._target, version)
        if self._follower is None or self._follower.done():
            self._follower = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        sync = self.synchronizer
        assert sync is not None
        # Quarantined (an update failed), it installs versions on its own until one verifies: no
        # generation comes to a quarantined replica, so no step would make it sync.
        while self._target > self.version or self.quarantined:
            version = await sync.committed_after(self._failed if self.quarantined else self.version)
            await self._update(version, sync.policy.pause_mode or "keep")
            event, self._moved = self._moved_event(), asyncio.Event()
            event.set()

    async def _update(self, version: int, pause_mode: str) -> None:
        """Transfer (generation goes on), then admit per the pause mode, apply, verify, reopen."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(self.update_time())  # the bytes arrive while generation goes on
        transfer = loop.time() - started
        while self._updating is not None:
            await self._updating.wait()
        self._updating = asyncio.Event()
        paused = loop.time()
        try:
            if pause_mode == "abort":
                for event in list(self._aborts):
                    event.set()
            elif pause_mode == "wait":
                while self._in_flight:
                    await asyncio.sleep(0.001)
            admitted = loop.time()
            self.version = version
            self._served.append((admitted, version))
        finally:
            event, self._updating = self._updating, None
            event.set()
        pause = loop.time() - paused
        timings = UpdateTimings(admit_seconds=admitted - paused, transfer_seconds=transfer, pause_seconds=pause)
        self.quarantined = self.fail_updates(version)
        if self.quarantined:
            self._failed = version
            record = UpdateRecord(self.name, version, UpdateOutcome.FAILED, failed_phase=UpdatePhase.VERIFY,
                                  reason="simulated fault: a tensor loaded wrong", timings=timings,
                                  served_version=version)
        else:
            coverage = self.measures(version)
            record = UpdateRecord(self.name, version, UpdateOutcome.VERIFIED if coverage.complete else
                                  UpdateOutcome.UNVERIFIED, resident_identity=b"\x01" * 16, timings=timings,
                                  served_version=version, coverage=coverage,
                                  reason="" if coverage.complete else coverage.describe())
        self.updates.append(record)
        if self.synchronizer is not None:
            self.synchronizer.report(record)
            # UNVERIFIED: out of service if the synchronizer's policy says so, as after a failure.
            self.quarantined = self.synchronizer.registered[self.name].quarantined
            self._failed = version if self.quarantined else self._failed

    # -- serving -------------------------------------------------------------
    async def generate(self, prompts: Sequence[PromptInput], sampling: SamplingSpec) -> list[list[Generation]]:
        if self.down or self.rng.random() < self.unavailable_probability:
            raise Unavailable(f"{self.name} is unavailable")
        await self._before_generate(RUN_STEP.get(), MIN_WEIGHT_VERSION.get())
        while self._updating is not None:  # new requests wait while weights change
            await self._updating.wait()
        aborted = asyncio.Event()
        self._aborts.add(aborted)
        self._in_flight += 1
        start = self.version
        began = asyncio.get_running_loop().time()
        try:
            sleeper = asyncio.ensure_future(asyncio.sleep(self.gen_time()))
            waiter = asyncio.ensure_future(aborted.wait())
            await asyncio.wait([sleeper, waiter], return_when=asyncio.FIRST_COMPLETED)
            sleeper.cancel()
            waiter.cancel()
        finally:
            self._aborts.discard(aborted)
            self._in_flight -= 1
        out = []
        for p in prompts:
            prompt_ids = p.token_ids or self._ids(p.text or "".join(m["content"] for m in p.messages or []))
            samples = []
            for _ in range(max(1, sampling.n)):
                n_tokens = min(self.response_tokens(self.rng), sampling.max_tokens)
                finish = FinishReason.ABORT if aborted.is_set() or self.rng.random() < self.abort_probability else (
                    FinishReason.LENGTH if n_tokens >= sampling.max_tokens else FinishReason.STOP
                )
                spans = self._spans(start, began, n_tokens)
                g = Generation(
                    prompt_token_ids=list(prompt_ids),
                    completion_token_ids=[1 + self.rng.randrange(997) for _ in range(n_tokens)],
                    completion_logprobs=[-self.rng.random() for _ in range(n_tokens)],
                    finish_reason=finish,
                    version_start=spans[0].version if spans else start,
                    version_end=spans[-1].version if spans else self.version,
                    text=self.text(p, self.rng),
                    engine=self.name,
                    version_spans=spans,
                )
                samples.append(g)
                self.generated.append(g)
            out.append(samples)
        return out

    def _spans(self, start: int, began: float, n_tokens: int) -> list[VersionSpan]:
        """The version of each of `n_tokens` made evenly over the generation that began at `began` on version
        `start` and ends now: a token made after an update landed is the new version's (pause mode keep)."""
        now = asyncio.get_running_loop().time()
        versions = []
        for i in range(n_tokens):
            at = began + (now - began) * (i + 1) / n_tokens
            versions.append(max([start, *(v for t, v in self._served if began < t <= at)]))
        return spans_of(versions)

    async def sessions(self) -> Any:
        raise FailedPrecondition(
            f"{self.name} is a simulated replica and serves no agent sessions: the external worker needs real "
            "rollout replicas"
        )
