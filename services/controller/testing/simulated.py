"""Simulated services, for tests and the pipeline benchmark only.

`SimulatedTrainer`, `SimulatedRolloutEngine` and `SimulatedSynchronizer`
implement the controller's Protocols with generation, training and
publishing times drawn from given distributions. They keep the one road of a
real run, with the rules the real services keep, through the same code where
it is shared:
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
`services/controller/adapters/`.

`VirtualTimeLoop` is an asyncio event loop whose clock jumps straight to the
next timer when nothing is runnable, so a simulated run of minutes takes
milliseconds and is deterministic for a given seed; a deadlock (nothing
runnable, no timer) raises instead of hanging.
"""

from __future__ import annotations

import asyncio
import math
import random
import selectors
import zlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from flywheel.common.provenance import VersionSpan, spans_of
from flywheel.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable
from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.policy import decide, required_version
from flywheel.synchronizer.types import (
    Component,
    EventKind,
    Identity,
    Method,
    Policy,
    Role,
    RolloutWait,
    State,
    Style,
    UpdateCoverage,
    UpdateOutcome,
    UpdatePhase,
    UpdateRecord,
    UpdateTimings,
)
from services.controller.domain import (
    MIN_WEIGHT_VERSION,
    RUN_STEP,
    FinishReason,
    Generation,
    PromptInput,
    RestoredCheckpoint,
    SamplingSpec,
    TrainerState,
    TrainResult,
)

T = TypeVar("T")
Draw = Callable[[], float]


# -- time distributions --------------------------------------------------------
def lognormal(mean: float, sigma: float, rng: random.Random) -> Draw:
    """Long-tailed times with the given mean (sigma is the log-space std)."""
    mu = math.log(mean) - sigma * sigma / 2
    return lambda: rng.lognormvariate(mu, sigma)


def normal(mean: float, cv: float, rng: random.Random) -> Draw:
    """Near-constant times: mean with coefficient of variation cv, at least 5% of the mean."""
    return lambda: max(0.05 * mean, rng.gauss(mean, cv * mean))


def constant(value: float) -> Draw:
    return lambda: value


# -- a virtual clock -------------------------------------------------------------
class SimulationDeadlock(RuntimeError):
    """Nothing could ever run again: every task waits on something no one will set."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None):  # type: ignore[override]
        ready = super().select(0)
        if ready or self.loop is None:
            return ready
        if timeout is None:
            # Only a thread (to_thread, an executor) can still wake us: give it a real moment.
            ready = super().select(1.0)
            if ready:
                return ready
            raise SimulationDeadlock("simulation deadlocked: no runnable task and no timer")
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


async def _settle(tasks: set[asyncio.Task]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine on a fresh VirtualTimeLoop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(_settle(leftover))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


# -- the synchronizer --------------------------------------------------------------
TRAINER_ID = "trainer"


@dataclass
class SimulatedSynchronizer:
    """The synchronizer's rules in memory: the policy, the committed versions, the components, events."""

    policy: Policy = field(default_factory=Policy)
    latest: int = 0
    #: The least version asked for outside the schedule and not committed yet (0: none).
    wanted: int = 0
    #: Every registered component, by id.
    registered: dict[str, Component] = field(default_factory=dict)
    #: Every update result the replicas reported, in order.
    results: list[UpdateRecord] = field(default_factory=list)
    configured: dict[str, Any] = field(default_factory=dict)
    #: UNVERIFIED updates leave the replica serving (the default quarantines it, as a failure).
    accept_unverified: bool = False
    #: Called when the trainer should ask NeedSync between steps (SimulatedTrainer.wake).
    wake_trainer: Callable[[], None] = lambda: None
    _subscribers: list[asyncio.Queue] = field(default_factory=list)
    _sequence: int = 0
    _committed: asyncio.Event | None = None

    # -- the controller's side (the Synchronizer protocol) ---------------------
    async def configure_policy(
        self, *, style: str, method: str, interval: int, offset: int, timeout_seconds: float, rollout_wait: str,
        max_staleness: int, pause_mode: str,
    ) -> None:
        self.configured = dict(style=style, method=method, interval=interval, offset=offset,
                               timeout_seconds=timeout_seconds, rollout_wait=rollout_wait,
                               max_staleness=max_staleness, pause_mode=pause_mode)
        self.policy = Policy(Style[style.upper()], Method[method.upper()], interval, offset, timeout_seconds,
                             RolloutWait[rollout_wait.upper()], max_staleness, pause_mode)

    async def events(self, send_initial: bool) -> AsyncIterator[WatchEvent]:
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            if send_initial:
                for c in list(self.registered.values()):
                    yield self._event(EventKind.STATE_CHANGED, c)
            while True:
                yield await queue.get()
        finally:
            self._subscribers.remove(queue)

    async def latest_version(self) -> int:
        return self.latest

    async def components(self) -> list[Component]:
        return [replace(c) for c in self.registered.values()]

    async def updates(self, version: int) -> list[UpdateRecord]:
        return [r for r in self.results if r.version == version]

    async def request_version(self, min_version: int, reason: str) -> int:
        if self.latest < min_version:
            self.wanted = max(self.wanted, min_version)
            self._publish(EventKind.VERSION_REQUESTED, version=min_version, message=reason)
            self.wake_trainer()
        return self.latest

    # -- the services' side ----------------------------------------------------
    def register(self, role: Role, component_id: str) -> Component:
        c = Component(Identity(role, component_id, address=f"sim://{component_id}"))
        self.registered[component_id] = c
        self._publish(EventKind.COMPONENT_REGISTERED, c)
        return c

    def need_sync(self, component_id: str, step: int) -> Any:
        c = self.registered[component_id]
        c.step = step
        rollouts = [r for r in self.registered.values() if r.role == Role.ROLLOUT]
        decision = decide(self.policy, c, step, self.latest, rollouts, False, self.wanted)
        if decision.new_request:
            c.request_step, c.awaited_version = step, decision.version
            c.state = decision.state
            self._publish(EventKind.SYNC_REQUESTED, c, version=decision.version)
            self.wake_trainer()
        elif decision.state != c.state:
            c.state = decision.state
            self._publish(EventKind.STATE_CHANGED, c)
        return decision

    def commit(self, version: int) -> None:
        self.latest = max(self.latest, version)
        if self.wanted <= version:
            self.wanted = 0
        self.registered[TRAINER_ID].weight_version = version
        self._publish(EventKind.VERSION_COMMITTED, version=version, method=self.policy.method)
        event, self._committed = self._committed_event(), asyncio.Event()
        event.set()

    async def committed_after(self, version: int) -> int:
        """The newest committed version once it is newer than `version`."""
        while self.latest <= version:
            await self._committed_event().wait()
        return self.latest

    def report(self, record: UpdateRecord) -> None:
        c = self.registered[record.component_id]
        self.results.append(record)
        c.weight_version = record.served_version
        if record.verified or (record.outcome == UpdateOutcome.UNVERIFIED and self.accept_unverified):
            c.quarantined, c.quarantine_reason = False, ""
            if c.awaited_version and c.weight_version >= c.awaited_version:
                c.last_sync_step, c.state = max(c.last_sync_step, c.request_step), State.RUNNING
        elif record.outcome == UpdateOutcome.UNVERIFIED:
            c.quarantined, c.quarantine_reason = True, f"version {record.version} unverified: {record.reason}"
        else:
            phase = record.failed_phase.name.lower() if record.failed_phase else "update"
            c.quarantined = True
            c.quarantine_reason = f"{phase} of version {record.version} failed: {record.reason}"
        self._publish(EventKind.UPDATE_REPORTED, c, version=record.version, update=record)

    def _committed_event(self) -> asyncio.Event:
        if self._committed is None:
            self._committed = asyncio.Event()
        return self._committed

    def _event(self, kind: EventKind, component: Component | None = None, **fields: Any) -> WatchEvent:
        self._sequence += 1
        return WatchEvent(
            kind=kind, sequence=self._sequence, unix_ms=0, latest_version=self.latest,
            component=replace(component) if component is not None else None, version=fields.get("version", 0),
            method=fields.get("method"), location="", group=None, transfer_state=None,
            message=fields.get("message", ""), update=fields.get("update"),
        )

    def _publish(self, kind: EventKind, component: Component | None = None, **fields: Any) -> None:
        event = self._event(kind, component, **fields)
        for queue in self._subscribers:
            queue.put_nowait(event)


# -- the trainer -------------------------------------------------------------
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


# -- a rollout replica ------------------------------------------------------------
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
