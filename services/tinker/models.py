"""Sessions and training models of the Tinker gateway.

A model's requests (forward_backward, optim_step, save...) carry a `seq_id`
1, 2, 3... (create_model is 0) and run strictly in that order, whatever order
they arrive in: the SDK sends the chunks of one forward_backward in parallel.
Gradients add up in the trainer across forward_backward calls until
optim_step. A request sent again (the same model and seq_id, as the SDK's
retries do) gets the first one's request id and is never run twice.

One trainer holds several LoRA models on its base (the trainer's
SelectModel: each model its own adapters, gradients, optimizer state and
step, and its own LoRA rank and modules within the trainer's, `lora_shape`).
Models' requests take turns on the trainer, one request at a time,
the turns going round the tenants that wait (services/tinker/turns.py: a
tenant with many models or a long queue does not hold up another), and each
turn first selects its model there, so two clients training at once
never touch each other's weights. Selecting on every turn (a call of about a
millisecond) rather than remembering the selection means a trainer that
restarted and lost a model is found at that model's next request instead of
training another model's adapters: the empty model the trainer made in its
place is dropped at once, and the model is lost for good, every request of
it (those waiting, and every one after) refused until the client loads a save
into a new model. A model whose session ended is dropped from the trainer.

Sessions and models belong to the tenant whose key made them (services/tinker/
tenants.py): another tenant's are not found (404), by id. A session that
ended is forgotten `forget_seconds` later, with its models and what the
gateway kept for them (`Sessions.forgettable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from flywheel.errors import AlreadyExists, FailedPrecondition, FlywheelError, InvalidArgument, NotFound
from flywheel.trainer.types import LoraShape
from services.tinker.futures import Futures, Outcome, failure
from services.tinker.metrics import TRAINER_TURNS
from services.tinker.turns import FairTurns

log = logging.getLogger(__name__)

#: Tinker's LoRA flags -> the module names they stand for in the Llama/Qwen families we serve.
LORA_MODULES = {
    "train_attn": frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}),
    "train_mlp": frozenset({"gate_proj", "up_proj", "down_proj"}),
    "train_unembed": frozenset({"lm_head"}),
}


@dataclass
class Session:
    session_id: str
    tenant: str
    created: float
    last_heartbeat: float
    #: How it ended ("success", "errored", "interrupted"); None while it runs. The first reason stays.
    ended: str | None = None
    detail: str | None = None
    #: When it ended (time.monotonic()); None while it runs.
    ended_at: float | None = None
    user_metadata: dict = field(default_factory=dict)


class Sessions:
    def __init__(self, timeout_seconds: float, forget_seconds: float = 3600.0) -> None:
        self.timeout_seconds = timeout_seconds
        self.forget_seconds = forget_seconds
        self._sessions: dict[str, Session] = {}

    def create(self, tenant: str, user_metadata: dict | None = None) -> Session:
        now = time.monotonic()
        session = Session(f"session-{uuid.uuid4().hex[:12]}", tenant, now, now, user_metadata=user_metadata or {})
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str, tenant: str) -> Session:
        """The session, if it is `tenant`'s (another tenant's is not found, as an unknown one)."""
        session = self._sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise NotFound(f"session {session_id!r} is not known here")
        self._expire(session)
        return session

    def _expire(self, session: Session) -> None:
        if session.ended is None and time.monotonic() - session.last_heartbeat > self.timeout_seconds:
            self._end(session, "expired", f"no heartbeat for {self.timeout_seconds:g} s")

    @staticmethod
    def _end(session: Session, reason: str, detail: str | None) -> None:
        session.ended, session.detail, session.ended_at = reason, detail, time.monotonic()

    def live(self, session_id: str, tenant: str) -> Session:
        """The session, if it runs: finished or silent past the timeout, FailedPrecondition."""
        session = self.get(session_id, tenant)
        if session.ended is not None:
            raise FailedPrecondition(f"session {session_id} has finished ({session.ended})")
        return session

    def runs(self, session_id: str) -> bool:
        session = self._sessions.get(session_id)
        if session is None:
            return False
        self._expire(session)
        return session.ended is None

    def running(self) -> int:
        """Sessions neither finished nor silent past the timeout."""
        cutoff = time.monotonic() - self.timeout_seconds
        return sum(1 for s in self._sessions.values() if s.ended is None and s.last_heartbeat >= cutoff)

    def of_tenant(self, tenant: str) -> list[Session]:
        return [s for s in self._sessions.values() if s.tenant == tenant]

    def heartbeat(self, session_id: str, tenant: str) -> None:
        self.live(session_id, tenant).last_heartbeat = time.monotonic()

    def finish(self, session_id: str, tenant: str, reason: str, detail: str | None) -> Session:
        session = self.get(session_id, tenant)
        if session.ended is None:
            self._end(session, reason, detail)
        return session

    def ended(self) -> list[Session]:
        """The sessions that ended (finished, or silent past the timeout)."""
        for session in self._sessions.values():
            self._expire(session)
        return [s for s in self._sessions.values() if s.ended is not None]

    def forgettable(self) -> list[str]:
        """Forgets the sessions that ended `forget_seconds` ago or more; their ids."""
        cutoff = time.monotonic() - self.forget_seconds
        gone = [s.session_id for s in self.ended() if s.ended_at is not None and s.ended_at <= cutoff]
        for session_id in gone:
            del self._sessions[session_id]
        return gone


@dataclass
class Request:
    """One of a model's requests: its id, and what it does once its turn comes."""

    request_id: str
    work: Callable[[], Awaitable[Outcome]]


@dataclass
class TrainingModel:
    model_id: str
    session_id: str
    tenant: str
    base_model: str
    lora_rank: int
    user_metadata: dict = field(default_factory=dict)
    #: Its adapters' rank and modules, made when the trainer creates it (a load brings the save's own).
    shape: LoraShape = LoraShape()
    #: The next seq_id to run (create_model was 0).
    next_seq: int = 1
    #: Every seq_id seen -> its request id (a retried request gets the same).
    seen: dict[int, str] = field(default_factory=dict)
    waiting: dict[int, Request] = field(default_factory=dict)
    #: seq_ids of requests refused before they were queued: the SDK numbered them, nothing runs for them.
    passed_over: set[int] = field(default_factory=set)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task | None = None
    #: Why it takes no more requests (its session ended, the trainer lost it); None while it trains.
    retired: str | None = None


#: Makes a model the trainer's live one (of this shape if it creates it); returns whether the trainer created it.
Select = Callable[[str, LoraShape], Awaitable[bool]]
#: Forgets a model on the trainer.
Drop = Callable[[str], Awaitable[None]]


class TrainingModels:
    """The gateway's models, each running its requests in seq_id order, all taking turns on one trainer."""

    def __init__(self, futures: Futures, select: Select, drop: Drop) -> None:
        self.futures = futures
        self._select, self._drop = select, drop
        self._models: dict[str, TrainingModel] = {}
        #: The trainer's turns, going round the tenants that wait (services/tinker/turns.py).
        self.turns = FairTurns()

    @contextlib.asynccontextmanager
    async def turn(self, model_id: str, tenant: str, *, new: bool = False,
                   shape: LoraShape = LoraShape()) -> AsyncIterator[None]:
        """The trainer, with `tenant`'s `model_id` selected on it, until the block ends. `new`: the model is
        being created (the trainer must not hold it yet), of `shape`; otherwise the trainer must hold it
        already: one it lost is lost for good (see the module doc)."""
        async with self.turns.turn(tenant):
            TRAINER_TURNS.labels(tenant).inc()
            created = await self._select(model_id, shape)
            if created != new:
                if new:
                    raise AlreadyExists(f"the trainer holds a model {model_id!r} already")
                await self._lose(model_id)
            yield

    async def _lose(self, model_id: str) -> None:
        """The trainer made `model_id` anew (it had lost it): drops that empty model, refuses the lost one's
        requests from now on, and raises. Called holding the turn."""
        reason = (f"the trainer no longer holds model {model_id} (it restarted?): its adapters and optimizer state "
                  "are gone; load a saved checkpoint into a new model (create_training_client_from_state_with_"
                  "optimizer)")
        try:
            await self._select("", LoraShape())
            await self._drop(model_id)
        except FlywheelError as exc:
            log.warning("the lost model's empty stand-in was not dropped", extra={"model_id": model_id,
                                                                                 "error": str(exc)})
        model = self._models.get(model_id)
        if model is not None and model.retired is None:
            self._stop(model, reason)
        log.warning("model lost on the trainer", extra={"model_id": model_id})
        raise FailedPrecondition(reason)

    def _stop(self, model: TrainingModel, reason: str) -> None:
        """No more requests of `model`: those waiting answer `reason`."""
        model.retired = reason
        for request in model.waiting.values():
            self.futures.finish(request.request_id, failure(FailedPrecondition(f"model {model.model_id}: {reason}")))
        model.waiting.clear()
        model.wakeup.set()  # its runner stops once the request it may be running has answered

    def add(self, model: TrainingModel) -> TrainingModel:
        """Starts running `model`'s requests (it was created on the trainer)."""
        self._models[model.model_id] = model
        model.runner = asyncio.create_task(self._run(model), name=f"tinker model {model.model_id}")
        return model

    def get(self, model_id: str, tenant: str) -> TrainingModel:
        """`tenant`'s model `model_id`, if it takes requests (another tenant's is not found)."""
        model = self._models.get(model_id)
        if model is None or model.tenant != tenant:
            raise NotFound(f"model {model_id!r} is not known here")
        if model.retired is not None:
            raise FailedPrecondition(f"model {model_id} takes no more requests: {model.retired}")
        return model

    def known(self, model_id: str) -> TrainingModel | None:
        """A model this gateway made, training or retired."""
        return self._models.get(model_id)

    def of_tenant(self, tenant: str) -> list[TrainingModel]:
        return [m for m in self._models.values() if m.tenant == tenant]

    def forget(self, session_ids: set[str]) -> None:
        """Forgets the (retired) models of `session_ids`."""
        for model_id in [m.model_id for m in self._models.values()
                         if m.session_id in session_ids and m.retired is not None]:
            del self._models[model_id]

    def of_session(self, session_id: str) -> list[TrainingModel]:
        return [m for m in self._models.values() if m.session_id == session_id and m.retired is None]

    def training(self) -> list[TrainingModel]:
        return [m for m in self._models.values() if m.retired is None]

    async def retire(self, model: TrainingModel, reason: str) -> None:
        """Stops `model` (its waiting requests answer `reason`) and drops it from the trainer."""
        if model.retired is not None:
            return
        self._stop(model, reason)
        try:
            async with self.turns.turn(model.tenant):
                await self._select("", LoraShape())  # the trainer's own model: a model is dropped while parked
                await self._drop(model.model_id)
        except FlywheelError as exc:  # a trainer that restarted has lost it already
            log.warning("model not dropped from the trainer", extra={"model_id": model.model_id, "error": str(exc)})
        log.info("model retired", extra={"model_id": model.model_id, "reason": reason})

    def submit(self, model_id: str, tenant: str, seq_id: int | None, label: str,
               work: Callable[[], Awaitable[Outcome]]) -> str:
        """The request id of `model_id`'s request `seq_id`, which runs once every earlier one has,
        in a turn of the trainer with the model selected."""
        model = self.get(model_id, tenant)
        if seq_id is None or seq_id < 1:
            raise InvalidArgument(f"{label}: seq_id must be 1 or more (create_model is 0), got {seq_id}")
        known = model.seen.get(seq_id)
        if known is not None:
            return known  # sent again: the first one's answer
        if seq_id < model.next_seq:
            raise InvalidArgument(f"{label}: seq_id {seq_id} of model {model_id} is older than the requests run")
        request_id = self.futures.new(label, tenant)
        model.seen[seq_id] = request_id
        model.waiting[seq_id] = Request(request_id, work)
        model.wakeup.set()
        return request_id

    def pass_over(self, model_id: object, tenant: str, seq_id: object) -> None:
        """A request numbered `seq_id` for `model_id` was refused before it was queued (a route not served,
        a bad body): the model's later requests must not wait for it. Nothing for a model or number that is
        not the caller's to skip (unknown, another tenant's, or one already queued or run)."""
        model = self._models.get(str(model_id))
        if model is None or model.tenant != tenant or not isinstance(seq_id, int) or isinstance(seq_id, bool):
            return
        if seq_id >= model.next_seq and seq_id not in model.seen:
            model.passed_over.add(seq_id)
            model.wakeup.set()

    async def _run(self, model: TrainingModel) -> None:
        while model.retired is None:
            if model.next_seq in model.passed_over:
                model.passed_over.discard(model.next_seq)
                model.next_seq += 1
                continue
            request = model.waiting.pop(model.next_seq, None)
            if request is None:
                model.wakeup.clear()
                await model.wakeup.wait()
                continue
            model.next_seq += 1
            await self.futures.run(request.request_id, functools.partial(self._in_turn, model, request.work))

    async def _in_turn(self, model: TrainingModel, work: Callable[[], Awaitable[Outcome]]) -> Outcome:
        async with self.turn(model.model_id, model.tenant):
            return await work()

    async def close(self) -> None:
        for model in self._models.values():
            if model.runner is not None:
                model.runner.cancel()
        await asyncio.gather(*(m.runner for m in self._models.values() if m.runner), return_exceptions=True)


def lora_shape(rank: int, flags: dict[str, bool], trainer_rank: int, trainer_modules: tuple[str, ...]) -> LoraShape:
    """The model's own adapters, as a client asks for them (rank, and which modules: the SDK's train_attn,
    train_mlp, train_unembed), within the trainer's: each model trains a LoRA of its own rank on its own
    modules (the trainer's Policy.set_shape)."""
    if trainer_rank == 0:
        raise FailedPrecondition("lora_config: this gateway's trainer trains every parameter, not LoRA adapters; "
                                 "start the trainer with model.lora.enabled")
    if not 1 <= rank <= trainer_rank:
        raise InvalidArgument(f"lora_config.rank: from 1 to {trainer_rank} (the trainer's model.lora.rank, the "
                              f"largest a model may have), got {rank}")
    modules = set(trainer_modules)
    if "all-linear" in modules:  # peft: every linear layer but the output head
        modules = (modules - {"all-linear"}) | LORA_MODULES["train_attn"] | LORA_MODULES["train_mlp"]
    wanted: set[str] = set()
    for flag, names in LORA_MODULES.items():
        if flags.get(flag, True):
            if missing := names - modules:
                raise InvalidArgument(
                    f"lora_config.{flag}: the trainer has no adapters on {', '.join(sorted(missing))} (its target "
                    f"modules: {', '.join(trainer_modules)}); set {flag}=False")
            wanted |= names
    if not wanted:
        raise InvalidArgument("lora_config: train_attn, train_mlp and train_unembed are all False: nothing to train")
    return LoraShape(rank, tuple(sorted(wanted)))