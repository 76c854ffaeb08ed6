"""What the Tinker API's training calls do, over the trainer service (the HTTP
layer only translates: services/tinker/http_api.py; sampling:
services/tinker/sampler_sessions.py; runs and saves on disk and the REST
calls on them: services/tinker/checkpoints.py, services/tinker/rest.py).

Every call carries the caller's tenant (services/tinker/tenants.py): what a
tenant makes is its own, and another tenant's is not found.

The trainer holds every model of the gateway, each a LoRA model on its base
(services/tinker/models.py): a new model starts from the base weights, the
adapters' initialisation and a fresh optimizer; a model created from a
checkpoint (create-via-load) gets that checkpoint's weights and optimizer
state instead. A model whose session finished or went silent is dropped from
the trainer, and forgotten with its session `forget_seconds` later.
Named checkpoints (save_weights) are `tinker://<model id>/weights/<name>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from typing import Any

from flywheel.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from flywheel.rollout.client import RolloutClient
from flywheel.runtime.client import translated
from flywheel.trainer.client import TrainerClient
from flywheel.trainer.types import LoraShape
from services.tinker.bodies import refuse_unknown, seq_number
from services.tinker.checkpoints import RECORD, Checkpoints, ttl_and_metadata, write_json
from services.tinker.config import TinkerConfig
from services.tinker.futures import Futures, Outcome
from services.tinker.models import LORA_MODULES, Sessions, TrainingModel, TrainingModels, lora_shape
from services.tinker.paths import TinkerPath, check_name
from services.tinker.sampler import Sampler
from services.tinker.sampler_sessions import SamplingSessions
from services.tinker.wire import adam_step, forward_backward_output, trainer_call

log = logging.getLogger(__name__)


class Gateway:
    def __init__(self, config: TinkerConfig, trainer: TrainerClient, rollout: RolloutClient | None = None) -> None:
        self.config = config
        self.trainer = trainer
        self.sampler = Sampler(rollout, config.trainer_timeout_seconds, config.sampler_keep_unnamed) \
            if rollout is not None else None
        self.checkpoints = Checkpoints(config.checkpoint_dir, config.sampler_dir)
        self.futures = Futures()
        self.sessions = Sessions(config.session_timeout_seconds, config.forget_seconds)
        self.models = TrainingModels(self.futures, self._select, self._drop)
        self.sampling = SamplingSessions(self)
        self._retiring: set[asyncio.Task] = set()
        self._created: dict[tuple[str, int], str] = {}  # (session, model_seq_id) -> create_model's request id
        self._pruner: asyncio.Task | None = None
        self.base_model = config.base_model
        self.lora_rank = 0
        self.lora_modules: tuple[str, ...] = ()

    async def start(self) -> None:
        """Learns what the trainer holds (its model and adapters) and what the sampler serves, waiting
        for both to be up and loaded (a gateway may start first: Kubernetes starts pods in no order)."""
        deadline = time.monotonic() + self.config.wait_seconds

        async def loaded_trainer():
            info = await self.trainer.get_info(timeout=10.0)
            return info if info.ready else None

        info = await self._wait_for(f"trainer {self.config.trainer_address}", loaded_trainer, deadline)
        if self.sampler is not None:
            await self._wait_for(f"rollout {self.config.rollout_address}", self.sampler.start, deadline)
        self.base_model = self.config.base_model or info.model_name
        self.lora_rank, self.lora_modules = info.lora_rank, tuple(info.lora_target_modules)
        # Models a gateway that ran before this one made: their sessions are gone with it.
        orphans = [model_id for model_id in info.model_ids if model_id]
        if orphans:
            await self._select("")
            for orphan in orphans:
                await self._drop(orphan)
            log.info("models of an earlier gateway dropped from the trainer", extra={"models": orphans})
        self.sampling.adopt_saved()
        self.checkpoints.measure_all()
        self._pruner = asyncio.create_task(self._prune_every(), name="tinker prune")

    async def _select(self, model_id: str, shape: LoraShape = LoraShape()) -> bool:
        with translated("trainer SelectModel"):
            return await self.trainer.select_model(model_id, shape=shape,
                                                   timeout=self.config.trainer_timeout_seconds)

    async def _drop(self, model_id: str) -> None:
        with translated("trainer DropModel"):
            await self.trainer.drop_model(model_id, timeout=self.config.trainer_timeout_seconds)

    async def _wait_for(self, what: str, call, deadline: float):
        """`call()`'s answer once it gives one (not None), retrying while it is unavailable or not ready."""
        while True:
            try:
                with translated(what):
                    answer = await call()
                if answer is not None:
                    return answer
                waiting_for = "to load its model"
            except Unavailable as exc:
                waiting_for = f"to answer ({exc})"
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"the {what} did not come up within wait_seconds="
                                         f"{self.config.wait_seconds:g}: waiting for it {waiting_for}")
            log.info("waiting for the %s %s", what, waiting_for)
            await asyncio.sleep(2.0)

    async def close(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruner
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await self.models.close()

    # -- service and sessions ------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.base_model, "trainable": True,
                                      "sampleable": self.sampler is not None}]}

    def create_session(self, tenant: str, body: dict[str, Any]) -> str:
        metadata = body.get("user_metadata") or {}
        return self.sessions.create(tenant, metadata if isinstance(metadata, dict) else {}).session_id

    def finish_session(self, tenant: str, session_id: str, reason: str, detail: str | None) -> None:
        """Ends the session (the first reason stays) and drops its models from the trainer, in the
        background: a drop waits for the trainer's turn, which a long request may hold."""
        session = self.sessions.finish(session_id, tenant, reason, detail)
        self._retire_models_of(session.session_id, f"its session finished ({session.ended})")

    def _retire_models_of(self, session_id: str, reason: str) -> list[asyncio.Task]:
        tasks = []
        for model in self.models.of_session(session_id):
            task = asyncio.create_task(self.models.retire(model, reason))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            tasks.append(task)
        return tasks

    def prune(self) -> list[asyncio.Task]:
        """Retires the models of sessions that ended (the retirements it started are returned), and
        forgets sessions that ended long enough ago with everything the gateway kept for them."""
        retiring = [task for session in self.sessions.ended()
                    for task in self._retire_models_of(session.session_id, f"its session ended ({session.ended})")]
        gone = set(self.sessions.forgettable())
        if gone:
            self.models.forget(gone)
            for key in [k for k in self._created if k[0] in gone]:
                del self._created[key]
            self.sampling.forget(gone)
            log.info("ended sessions forgotten", extra={"sessions": len(gone)})
        return retiring

    async def _prune_every(self) -> None:
        while True:
            await asyncio.sleep(self.config.prune_seconds)
            try:
                self.prune()
                await self.sampling.remove_expired()
                self.checkpoints.remove_expired_training()
            except Exception:  # noqa: BLE001 - a failed round is logged; the next one tries again
                log.exception("pruning the gateway's state failed")

    # -- models --------------------------------------------------------------

    def _new_model(self, tenant: str, body: dict[str, Any], label: str, create) -> dict[str, Any]:
        """A create_model / create-via-load request: its request id (the same when sent again) and model id."""
        session = self.sessions.live(str(body.get("session_id", "")), tenant)
        seq = seq_number(body.get("model_seq_id"), f"{label}: model_seq_id")
        key = (session.session_id, seq)
        model_id = f"{session.session_id}:train:{seq}"
        if key in self._created:  # sent again
            return {"request_id": self._created[key], "model_id": model_id}
        request_id = self._created[key] = self.futures.new(label, tenant)
        self.futures.run(request_id, lambda: create(session, model_id))
        return {"request_id": request_id, "model_id": model_id}

    def create_model(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        refuse_unknown(body, {"session_id", "model_seq_id", "base_model", "user_metadata", "lora_config",
                              "optimizer_config"}, "create_model")

        async def create(session, model_id: str) -> Outcome:
            base = body.get("base_model")
            if base != self.base_model:
                raise NotFound(f"base_model {base!r} is not served here; this gateway serves {self.base_model!r}")
            optimizer = body.get("optimizer_config") or {"type": "adamw"}
            if not isinstance(optimizer, dict) or optimizer.get("type") != "adamw":
                raise InvalidArgument(f"optimizer_config: only adamw is served, got {optimizer!r}")
            lora = body.get("lora_config")
            if lora is None:
                if self.lora_rank:
                    raise InvalidArgument(f"lora_config: the trainer trains LoRA adapters of rank {self.lora_rank}; "
                                          "a full fine-tuning model is not served by it")
                rank, shape = 0, LoraShape()
            else:
                refuse_unknown(lora, {"rank", "seed", *LORA_MODULES}, "lora_config")
                if lora.get("seed") is not None:
                    raise InvalidArgument("lora_config.seed: the adapters are initialised when the trainer starts "
                                          "(its model.seed); a per-model seed is not served")
                rank = int(lora.get("rank", 0))
                shape = lora_shape(rank, {k: bool(lora.get(k, True)) for k in LORA_MODULES}, self.lora_rank,
                                   self.lora_modules)
            metadata = body.get("user_metadata") or {}
            if not isinstance(metadata, dict):
                raise InvalidArgument("create_model: user_metadata must be an object")
            await self._create(TrainingModel(model_id, session.session_id, tenant, self.base_model, rank, metadata,
                                             shape), None)
            return Outcome(json={"type": "create_model", "model_id": model_id})

        return self._new_model(tenant, body, "create_model", create)

    async def _create(self, model: TrainingModel, load: str | None) -> None:
        """Creates `model` on the trainer from the adapters' initialisation, or from checkpoint `load`."""
        await asyncio.gather(*self.prune())  # a finished or silent session's models make room first
        async with self.models.turn(model.model_id, model.tenant, new=True, shape=model.shape):
            if load is not None:
                try:
                    with translated("trainer LoadCheckpoint"):
                        await self.trainer.load_checkpoint(load, timeout=self.config.trainer_timeout_seconds)
                except BaseException:
                    await self._select("")
                    await self._drop(model.model_id)
                    raise
            self.models.add(model)
        self.checkpoints.write_run(model.tenant, model.model_id, {
            "base_model": model.base_model, "lora_rank": model.lora_rank, "user_metadata": model.user_metadata,
            "session_id": model.session_id})

    def load_weights(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create-via-load (session_id + model_seq_id: a new model from a checkpoint) or a load into
        the model (model_id + seq_id, in its order)."""
        refuse_unknown(body, {"model_id", "seq_id", "session_id", "model_seq_id", "base_model", "user_metadata",
                              "path", "optimizer", "optimizer_config", "weights_access_token"}, "load_weights")
        if body.get("weights_access_token"):
            raise InvalidArgument("load_weights: weights_access_token is not served (weights are loaded from this "
                                  "gateway's own saves only)")

        # The path is the caller's tenant's, parsed strictly, before the request is accepted: 400 or 404 at once.
        path = self.checkpoints.resolve(tenant, body.get("path"), "load_weights: path", ("weights",))
        self.checkpoints.training_record(tenant, path)

        def checkpoint() -> tuple[TinkerPath, str, dict[str, Any]]:
            if not body.get("optimizer"):
                raise InvalidArgument("load_weights: weights without their optimizer state are not served yet "
                                      "(create_training_client_from_state, load_state); load with the optimizer "
                                      "(create_training_client_from_state_with_optimizer, load_state_with_optimizer)")
            if body.get("optimizer_config") not in (None, {"type": "adamw"}):
                raise InvalidArgument(f"load_weights: only adamw is served, got {body['optimizer_config']!r}")
            record = self.checkpoints.training_record(tenant, path)
            return path, record["trainer_path"], self.checkpoints.read_run(tenant, path.model_id)

        if body.get("session_id") is not None:
            async def create(session, model_id: str) -> Outcome:
                path, trainer_path, run = checkpoint()
                base = body.get("base_model") or run["base_model"]
                if base != self.base_model:
                    raise NotFound(f"base_model {base!r} is not served here; this gateway serves {self.base_model!r}")
                metadata = body.get("user_metadata") or run.get("user_metadata") or {}
                await self._create(TrainingModel(model_id, session.session_id, tenant, base, int(run["lora_rank"]),
                                                 metadata), trainer_path)
                return Outcome(json={"type": "load_weights", "path": str(path), "model_id": model_id})

            return self._new_model(tenant, body, "load_weights", create)

        model = self.models.get(str(body.get("model_id", "")), tenant)
        self.sessions.live(model.session_id, tenant)

        async def load() -> Outcome:
            path, trainer_path, run = checkpoint()
            if int(run["lora_rank"]) != model.lora_rank:
                raise InvalidArgument(f"load_weights: {path} has LoRA rank {run['lora_rank']}, the model "
                                      f"{model.lora_rank}")
            with translated("trainer LoadCheckpoint"):
                await self.trainer.load_checkpoint(trainer_path, timeout=self.config.trainer_timeout_seconds)
            return Outcome(json={"type": "load_weights", "path": str(path), "model_id": model.model_id})

        return {"request_id": self.models.submit(model.model_id, tenant, body.get("seq_id"), "load_weights", load),
                "model_id": model.model_id}

    def get_info(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        model = self.models.get(str(body.get("model_id", "")), tenant)
        return {
            "type": "get_info", "model_id": model.model_id, "model_name": model.base_model,
            # The tokenizer is the base model's: a local model directory loads without a hub.
            "model_data": {"model_name": model.base_model, "tokenizer_id": model.base_model},
            "is_lora": model.lora_rank > 0, "lora_rank": model.lora_rank or None,
            "optimizer_config": {"type": "adamw"},
        }

    def live_model(self, tenant: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id, tenant)
        self.sessions.live(model.session_id, tenant)
        return model

    # -- training ------------------------------------------------------------

    def forward_backward(self, tenant: str, request) -> dict[str, Any]:
        """`request`: the SDK's tinker.proto ForwardBackwardRequest."""
        model = self.live_model(tenant, request.model_id)
        timeout = self.config.trainer_timeout_seconds

        async def run() -> Outcome:
            call = trainer_call(request)
            with translated("trainer ForwardBackward"):
                result = await self.trainer.forward_backward(call.batch, call.loss, forward_only=call.forward_only,
                                                             timeout=timeout)
            return Outcome(proto=forward_backward_output(result, call.lengths))

        label = "forward" if request.forward_only else "forward_backward"
        return {"request_id": self.models.submit(model.model_id, tenant, request.seq_id, label, run),
                "model_id": model.model_id}

    def optim_step(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        model = self.live_model(tenant, str(body.get("model_id", "")))

        async def run() -> Outcome:
            refuse_unknown(body, {"model_id", "seq_id", "adam_params", "optimizer_params"}, "optim_step")
            adam = adam_step(body)
            with translated("trainer OptimStep"):
                result = await self.trainer.optim_step(adam=adam, timeout=self.config.trainer_timeout_seconds)
            return Outcome(json={"type": "optim_step", "metrics": {
                "grad_norm:mean": result.grad_norm, "learning_rate:mean": result.learning_rate,
                "step:max": float(result.step)}})

        return {"request_id": self.models.submit(model.model_id, tenant, body.get("seq_id"), "optim_step", run),
                "model_id": model.model_id}

    # -- named saves -----------------------------------------------------------

    def save_weights(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        model = self.live_model(tenant, str(body.get("model_id", "")))

        async def run() -> Outcome:
            refuse_unknown(body, {"model_id", "seq_id", "path", "ttl_seconds", "overwrite", "user_metadata"},
                           "save_weights")
            name = check_name(body.get("path") or f"step-{model.next_seq - 1}", "save_weights: path")
            ttl, metadata = ttl_and_metadata(body, "save_weights")
            self.checkpoints.remove_expired_training()
            path = TinkerPath(model.model_id, "weights", name)
            target = self.checkpoints.save_dir(tenant, path)
            if target.exists():
                if not body.get("overwrite"):
                    raise AlreadyExists(f"save_weights: {name!r} exists for model {model.model_id}; "
                                        "pass overwrite=True to replace it")
                shutil.rmtree(target)
            with translated("trainer SaveCheckpoint"):
                saved = await self.trainer.save_checkpoint(str(target), timeout=self.config.trainer_timeout_seconds)
            now = time.time()
            write_json(target / RECORD, {"name": name, "trainer_path": saved.path, "step": saved.step,
                                         "created": now, "expires": None if ttl is None else now + ttl,
                                         "user_metadata": metadata})
            self.checkpoints.measure(tenant)
            return Outcome(json={"type": "save_weights", "path": str(path)})

        return {"request_id": self.models.submit(model.model_id, tenant, body.get("seq_id"), "save_weights", run),
                "model_id": model.model_id}
