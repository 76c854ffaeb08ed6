"""The rollout service's domain core: admission, generation's gate and pause
modes, on top of one engine. Both transports (gRPC servicer and OpenAI HTTP)
call this for generation; weight updates go through `services.rollout.weights`
(the update transaction, `weights/transaction.py`), which closes and reopens
this gate.

Invariants:
- A request waits at the gate while an update (or a Pause) is in progress and
  reaches the engine only when it is open, so no request sees a half-updated
  model; the engine stamps every sample with the version of its first and
  last token.
- At most `limits.max_pending_requests` samples are admitted at once (waiting
  at the gate or in the engine); past that, QueueFull (RESOURCE_EXHAUSTED/429).
- A quarantined replica (its last update failed or did not verify: the
  weights it holds are not a version) refuses generation with UNAVAILABLE,
  also to a request that waited at the gate while that update ran, until an
  update verifies.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from flywheel.errors import Aborted, FailedPrecondition, ResourceExhausted, Unavailable
from services.rollout import metrics
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import Delta, Engine, PauseMode, SampleOutput, SamplingSpec, SequenceScores
from services.rollout.engine.text import TextCodec
from services.rollout.serving.adapters import AdapterCache, AdapterRef
from services.rollout.serving.prompts import PromptInput, ResolvedPrompt, resolve
from services.rollout.serving.scoring import check_score_request

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
    #: It ran while an update's probe held deliveries: it may have made tokens on weights not yet proven.
    held: bool = False
    #: It made tokens on weights that then failed verification: they are withheld, and it ends aborted.
    tainted: bool = False


def _withheld(final: SampleOutput) -> SampleOutput:
    """`final` ended aborted with nothing it made: its tokens came from weights that failed verification."""
    return replace(final, token_ids=[], logprobs=[], top_logprobs=[], text="", finish_reason="abort", stop_reason="",
                   version_end=final.version_start, version_spans=[], prompt_logprobs=[], kept_sets=[],
                   routed_experts=None)


class RolloutCore:
    def __init__(self, config: RolloutConfig, engine: Engine | None, codec: TextCodec | None, model_name: str) -> None:
        self.config = config
        self.engine = engine
        self.codec = codec
        self.model_name = model_name
        #: LoRA adapters resident beside the base weights (adapters.max_resident of them at most).
        self.adapters = AdapterCache(config.adapters, config.updates.checkpoint_root)
        self._pending = 0
        self._at_gate = 0
        self._open = asyncio.Event()
        self._open.set()
        self._paused = False
        self._updating = False
        #: Held by Pause, Resume and an update's swap (services.rollout.weights.transaction).
        self.control = asyncio.Lock()
        self._flights: set[_Flight] = set()
        #: Set by the synchronizer link: waits until a generation of (run_step,
        #: min_version) may run on the served weights (services.rollout.weights.follower).
        self.weights_gate: Callable[[int, int], Awaitable[None]] | None = None
        #: Why the replica takes no traffic (its last update failed or did not verify); "" when it serves.
        self.quarantine_reason = ""
        #: Set while results flow to callers. Cleared while an update's verification runs the engine (its
        #: probe) before the verdict: tokens in-flight requests make then (keep) are on weights not yet
        #: proven, and wait for it (`hold_deliveries`).
        self._deliveries = asyncio.Event()
        self._deliveries.set()
        metrics.WEIGHT_VERSION.set_function(lambda: self.engine.version if self.engine else 0)
        metrics.REQUESTS_RUNNING.set_function(lambda: self.engine.load().running if self.engine else 0)
        metrics.REQUESTS_WAITING.set_function(lambda: (self.engine.load().waiting if self.engine else 0) + self._at_gate)

    def attach(self, engine: Engine, codec: TextCodec) -> None:
        """Starts serving a started engine (called once, from the service's startup)."""
        self.engine, self.codec = engine, codec

    # -- prompts ---------------------------------------------------------------

    def adapters_served(self) -> bool:
        """Whether generation may name LoRA adapters (the config allows them and the engine serves them)."""
        return bool(self.config.adapters.max_resident) and self.engine is not None and self.engine.supports_adapters

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
        flight = self._start_flight(prompt.request_id)
        metrics.PROMPT_TOKENS.inc(len(prompt.ids))
        try:
            engine_id = f"{prompt.request_id}#{uuid.uuid4().hex[:12]}"
            async for deltas in engine.generate(engine_id, prompt.ids, spec, stream=stream):
                # The verdict taints every request that ran during the hold (`release_deliveries`), also
                # one whose tokens, made then, come out only after it: what counts is when they were made.
                await self._deliveries.wait()
                if flight.tainted:
                    # Made on weights that failed verification: nothing of it reaches the caller but its end,
                    # as an abort (the caller retries the work elsewhere).
                    deltas = [Delta(index=d.index, final=_withheld(d.final)) for d in deltas if d.final is not None]
                    if not deltas:
                        continue
                for d in deltas:
                    if d.final is not None:
                        metrics.GENERATED_TOKENS.inc(len(d.final.token_ids))
                        flight.aborted |= d.final.finish_reason == "abort"
                yield deltas
        finally:
            self._flights.discard(flight)
            flight.done.set()

    def _start_flight(self, request_id: str) -> _Flight:
        """Registers a request about to run on the engine, or refuses it (UNAVAILABLE) if the replica is
        quarantined. Checked here, with no await between the check and the registration: a request
        admitted earlier may have waited (for NeedSync, a version, the gate) while an update failed, and
        must not then run on the weights that failed. Once registered, a quarantine that follows reaches
        it through the swap's abort or the probe's verdict (`release_deliveries`)."""
        self._refuse_if_quarantined()
        flight = _Flight(request_id, held=not self._deliveries.is_set())
        self._flights.add(flight)
        return flight

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
        *, run_step: int = 0, min_version: int = 0, adapter: AdapterRef | None = None,
    ) -> list[PromptOutput]:
        """All prompts' samples, in order; aborted samples come back with finish reason "abort".

        `run_step`/`min_version`: the weights the generation must wait for (see follower.py).
        `adapter`: the LoRA adapter to sample with on top of them (serving.adapters)."""
        engine = self.require_engine()[0]
        if adapter is not None:
            self.adapters.check(adapter)
            spec = replace(spec, adapter=adapter.name)
        spec = engine.resolve(spec)
        await self._weights_ready(run_step, min_version)
        prompts = [p if p.request_id else ResolvedPrompt(p.ids, f"gen-{uuid.uuid4().hex[:16]}", p.tools) for p in prompts]
        async with self._admitted(len(prompts) * spec.n, reservation), self._adapter_held(engine, adapter):

            stamp = adapter.identity if adapter is not None else b""

            async def one(prompt: ResolvedPrompt) -> PromptOutput:
                finals: list[SampleOutput] = []
                async for deltas in self._run_one(prompt, spec, stream=False):
                    finals += [replace(d.final, adapter_identity=stamp) for d in deltas if d.final is not None]
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

    @asynccontextmanager
    async def _adapter_held(self, engine: Engine, adapter: AdapterRef | None) -> AsyncIterator[None]:
        """Keeps `adapter` resident (loaded and verified first) for as long as the generation runs."""
        if adapter is None:
            yield
            return
        async with self.adapters.use(engine, adapter):
            yield

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

    async def score(self, sequences: Sequence[Sequence[int]], top_logprobs: int = 0, *,
                    min_version: int = 0) -> list[SequenceScores]:
        """The Score call: log-probs of given token ids under the served weights (a prefill), admitted and
        gated like a generation (one sample per sequence); InvalidArgument / ResourceExhausted for bad or
        too much input (services.rollout.serving.scoring)."""
        engine, _ = self.require_engine()
        checked = check_score_request(sequences, top_logprobs, self.config.limits, vocab_size=engine.vocab_size,
                                      max_model_len=engine.max_model_len)
        await self._weights_ready(0, min_version)
        async with self._admitted(len(checked), None):
            flight = self._start_flight(f"score-{uuid.uuid4().hex[:12]}")
            try:
                scores = await engine.score_tokens(checked, top_logprobs)
                # Scored while an update verifies the weights: they count only once they are proven.
                await self._deliveries.wait()
            finally:
                self._flights.discard(flight)
                flight.done.set()
            if flight.tainted:
                raise Aborted("the weights these scores came from failed verification; score again")
            metrics.PROMPT_TOKENS.inc(sum(len(ids) for ids in checked))
            return scores

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
        async with self.control:
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
        async with self.control:
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

    # -- the gate, as a weight update drives it ------------------------------------

    @property
    def paused(self) -> bool:
        """Paused by an operator (Pause): an update leaves the engine paused and the gate closed."""
        return self._paused

    @property
    def updating(self) -> bool:
        return self._updating

    @updating.setter
    def updating(self, value: bool) -> None:
        self._updating = value

    def close_gate(self) -> None:
        """New requests wait at the gate (an update's admit phase; call with `control` held)."""
        self._open.clear()

    def open_gate(self) -> None:
        """Reopens the gate, unless an operator's Pause keeps it closed (call with `control` held)."""
        if not self._paused:
            self._open.set()

    async def pause_engine(self, mode: PauseMode) -> list[str]:
        """Pauses the engine (the gate is the caller's); for abort, the request ids that ended aborted."""
        return await self._pause_engine(mode)

    def quarantine(self, reason: str) -> None:
        """Refuses generation until `lift_quarantine` (an update that verified). Set before the gate
        can reopen, so that no request waiting there goes on with the weights held."""
        self.quarantine_reason = reason

    def lift_quarantine(self) -> None:
        self.quarantine_reason = ""

    def hold_deliveries(self) -> None:
        """Holds what in-flight requests produce until `release_deliveries` (an update verifying its
        weights with the engine running)."""
        for flight in self._flights:
            flight.held = True
        self._deliveries.clear()

    def release_deliveries(self, proven: bool) -> None:
        """Lets held results go on; `proven` False: the weights they came from failed, and the requests
        that made tokens meanwhile end aborted, their tokens withheld."""
        for flight in self._flights:
            flight.tainted |= flight.held and not proven
            flight.held = False
        self._deliveries.set()


