"""Simulated engines, for tests and the pipeline benchmark only.

`SimulatedTrainer`, `SimulatedRolloutEngine` and `SimulatedSynchronizer`
implement the controller's Protocols with generation, training and transfer
times drawn from given distributions, and keep the bookkeeping a real
service would enforce (the trainer rejects samples from a version newer than
its own and a wrong expected_step; an engine moves versions all at once and
honours the pause modes: keep, wait, abort). Nothing here is on the product
path: real runs use `services/controller/adapters/`.

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

from flywheel.errors import FailedPrecondition, Unavailable
from services.controller.domain import (
    FinishReason,
    Generation,
    NcclGroup,
    PromptInput,
    RestoredCheckpoint,
    SamplingSpec,
    TrainerState,
    TrainResult,
    WeightSource,
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


# -- the trainer -------------------------------------------------------------
@dataclass
class SimulatedTrainer:
    train_time: Draw = field(default_factory=lambda: constant(0.01))
    export_time: Draw = field(default_factory=lambda: constant(0.0))
    step: int = 0
    version: int = 0
    #: (trainer version at training, start version of each sample) per step.
    trained: list[tuple[int, list[int]]] = field(default_factory=list)
    checkpoints: dict[str, tuple[int, int, bytes]] = field(default_factory=dict)
    exports: int = 0
    _busy: bool = False

    async def get_state(self) -> TrainerState:
        return TrainerState(self.step, self.version)

    async def train_step(self, batch, loss, *, micro_batch_size: int, expected_step: int | None) -> TrainResult:
        if self._busy:
            raise FailedPrecondition("a train step is already running")
        if expected_step is not None and expected_step != self.step:
            raise FailedPrecondition(f"expected step {expected_step}, trainer is at {self.step}")
        versions = batch.tensors["weight_versions"].tolist()
        if max(versions) > self.version:
            raise FailedPrecondition(f"samples from version {max(versions)} but the trainer is at {self.version}")
        self._busy = True
        try:
            await asyncio.sleep(self.train_time())
        finally:
            self._busy = False
        self.trained.append((self.version, versions))
        self.step += 1
        self.version += 1
        return TrainResult(self.step, self.version, batch.tokens, {"loss": 0.0, "grad_norm": 1.0})

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

    async def export_weights(self, source: WeightSource) -> WeightSource:
        self.exports += 1
        await asyncio.sleep(self.export_time())
        if source.method == "checkpoint":
            return replace(source, path=f"sim://weights/v{self.version}")
        return source


# -- a rollout engine ------------------------------------------------------------
def _default_text(prompt: PromptInput, rng: random.Random) -> str:
    return f"The answer is \\boxed{{{rng.randint(0, 3)}}}"


@dataclass
class SimulatedRolloutEngine:
    name: str = "sim-rollout-0"
    #: Time of one Generate call (all n samples of a prompt finish together).
    gen_time: Draw = field(default_factory=lambda: constant(0.01))
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
    _updating: asyncio.Event | None = None
    _aborts: set[asyncio.Event] = field(default_factory=set)
    _in_flight: int = 0

    def _ids(self, text: str, n: int | None = None) -> list[int]:
        seed = zlib.crc32(text.encode())
        count = n if n is not None else max(1, len(text) // 4)
        return [1 + (seed + 7919 * i) % 997 for i in range(count)]

    async def tokenize(self, *, text=None, messages=None, add_generation_prompt: bool = True) -> list[int]:
        if self.down:
            raise Unavailable(f"{self.name} is down")
        body = text if text is not None else "".join(f"{m['role']}:{m['content']}" for m in messages or [])
        return self._ids(body)

    async def weight_version(self) -> int:
        if self.down:
            raise Unavailable(f"{self.name} is down")
        return self.version

    async def generate(self, prompts: Sequence[PromptInput], sampling: SamplingSpec) -> list[list[Generation]]:
        if self.down or self.rng.random() < self.unavailable_probability:
            raise Unavailable(f"{self.name} is unavailable")
        while self._updating is not None:  # new requests wait while weights change
            await self._updating.wait()
        aborted = asyncio.Event()
        self._aborts.add(aborted)
        self._in_flight += 1
        start = self.version
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
                g = Generation(
                    prompt_token_ids=list(prompt_ids),
                    completion_token_ids=[1 + self.rng.randrange(997) for _ in range(n_tokens)],
                    completion_logprobs=[-self.rng.random() for _ in range(n_tokens)],
                    finish_reason=finish,
                    version_start=start,
                    version_end=self.version,
                    text=self.text(p, self.rng),
                    engine=self.name,
                )
                samples.append(g)
                self.generated.append(g)
            out.append(samples)
        return out

    async def update_weights(self, version: int, source: WeightSource, *, pause_mode: str) -> int:
        if self.down:
            raise Unavailable(f"{self.name} is down")
        if version <= self.version:
            raise FailedPrecondition(f"{self.name} already serves version {self.version} >= {version}")
        while self._updating is not None:
            await self._updating.wait()
        self._updating = asyncio.Event()
        try:
            if pause_mode == "abort":
                for event in list(self._aborts):
                    event.set()
            elif pause_mode == "wait":
                while self._in_flight:
                    await asyncio.sleep(0.001)
            await asyncio.sleep(self.update_time())
            self.version = version
        finally:
            event, self._updating = self._updating, None
            event.set()
        return self.version

    async def sessions(self) -> Any:
        raise FailedPrecondition(
            f"{self.name} is a simulated replica and serves no agent sessions: the external worker needs real "
            "rollout replicas"
        )


# -- the synchronizer --------------------------------------------------------------
@dataclass
class SimulatedSynchronizer:
    """Holds a newest version and the policy it was given; publishes nothing by itself."""

    latest: int = 0
    groups: int = 0
    configured: dict[str, Any] = field(default_factory=dict)

    async def configure_policy(self, **policy: Any) -> None:
        self.configured = policy

    async def events(self, send_initial: bool) -> AsyncIterator[Any]:
        await asyncio.Event().wait()  # a simulated synchronizer announces nothing
        yield None

    async def latest_version(self) -> int:
        return self.latest


    async def allocate_group(self, version: int, rollout_ids: Sequence[str], timeout_seconds: float) -> NcclGroup:
        self.groups += 1
        ranks = {"trainer": 0, **{rid: i + 1 for i, rid in enumerate(rollout_ids)}}
        return NcclGroup(f"sim-group-{self.groups}", "127.0.0.1:0", len(ranks), "gloo", ranks)


@dataclass
class SimulatedHealthProbe:
    name: str
    healthy: Callable[[], bool] = lambda: True

    async def check(self) -> bool:
        return self.healthy()
