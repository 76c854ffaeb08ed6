"""What the Tinker API's calls do, over the trainer service (the HTTP layer
only translates: services/tinker/http_api.py).

Named checkpoints (save_weights) live under `checkpoint_dir/<model id>/<name>/`,
written by the trainer (so the directory must be one both see), with a
`tinker.json` beside them holding the name, the expiry its `ttl_seconds`
gave it, and the caller's metadata; expired ones are removed when the next
save of the gateway runs. Their Tinker path is `tinker://<model id>/weights/<name>`.
Weights saved for the sampler are versions (services/tinker/sampling.py), named
`tinker://<model id>/sampler_weights/<name>` when the save names them.

The trainer holds every model of the gateway, each a LoRA model on its base
(services/tinker/models.py): a new model starts from the base weights, the
adapters' initialisation and a fresh optimizer; a model created from a
checkpoint (create-via-load) gets that checkpoint's weights and optimizer
state instead. A model whose session finished or went silent is dropped.
Each model's `run.json` (`checkpoint_dir/<model id>/`) keeps what
`GET training_runs/{id}` answers, across gateway restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flywheel.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from flywheel.rollout.client import RolloutClient
from flywheel.runtime.client import translated
from flywheel.trainer.client import TrainerClient
from services.tinker.config import TinkerConfig
from services.tinker.futures import Futures, Outcome
from services.tinker.models import LORA_MODULES, Sessions, TrainingModel, TrainingModels, check_lora
from services.tinker.sampling import Sampler, sample_plan, sample_response
from services.tinker.wire import adam_step, forward_backward_output, trainer_call

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Tinker's bounds on a checkpoint's time to live: an hour to ten years (None: never expires).
_TTL_RANGE = (3600, 10 * 365 * 24 * 3600)
_CHECKPOINT_RECORD = "tinker.json"
_RUN_RECORD = "run.json"


_PATH = re.compile(r"^tinker://(?P<model>[^/]+)/(?P<kind>weights|sampler_weights)/(?P<name>[^/]+)$")


@dataclass(frozen=True)
class SamplingSession:
    session_id: str
    sampling_session_id: str
    #: The weight version it samples: exactly (snapshot) or at least (inflight: then its model's newest).
    version: int
    exact: bool
    model_path: str | None
    #: The model whose weights it samples (None: the base model).
    model_id: str | None


def _iso(unix_seconds: float) -> str:
    return datetime.fromtimestamp(unix_seconds, timezone.utc).isoformat()


def _checkpoint_json(model_id: str, record: dict[str, Any]) -> dict[str, Any]:
    expires = record.get("expires")
    return {"checkpoint_id": f"weights/{record['name']}", "checkpoint_type": "training",
            "time": _iso(record["created"]), "tinker_path": f"tinker://{model_id}/weights/{record['name']}",
            "user_metadata": record.get("user_metadata") or None,
            "expires_at": None if expires is None else _iso(expires)}


def _ttl_and_metadata(body: dict[str, Any], what: str) -> tuple[int | None, dict[str, str]]:
    """A save's time to live (None: it never expires) and the caller's metadata, checked."""
    ttl = body.get("ttl_seconds")
    if ttl is not None and not (isinstance(ttl, int) and _TTL_RANGE[0] <= ttl <= _TTL_RANGE[1]):
        raise InvalidArgument(f"{what}: ttl_seconds must be {_TTL_RANGE[0]}..{_TTL_RANGE[1]} or null, got {ttl!r}")
    metadata = body.get("user_metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidArgument(f"{what}: user_metadata must map names to strings")
    return ttl, metadata


def _refuse_unknown(body: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(body) - allowed - {"type"})
    if unknown:
        raise InvalidArgument(f"{what}: {unknown[0]} is not served by this gateway")


class Gateway:
    def __init__(self, config: TinkerConfig, trainer: TrainerClient, rollout: RolloutClient | None = None) -> None:
        self.config = config
        self.trainer = trainer
        self.sampler = Sampler(rollout, config.trainer_timeout_seconds) if rollout is not None else None
        self.sampling_sessions: dict[str, SamplingSession] = {}
        self._sampler_weights: dict[tuple[str, str], int] = {}  # (model id, name) -> version
        # (sampling session, seq_id) -> its answer, as long as its result is kept (a resend gets the same).
        self._samples: dict[tuple[str, int], tuple[float, dict[str, Any]]] = {}
        self._sampling_created: dict[tuple[str, int], str] = {}  # (session, sampling_session_seq_id) -> its id
        self.futures = Futures()
        self.sessions = Sessions(config.session_timeout_seconds)
        self.models = TrainingModels(self.futures, self._select, self._drop)
        self._retiring: set[asyncio.Task] = set()
        self._created: dict[tuple[str, int], str] = {}  # (session, model_seq_id) -> create_model's request id
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

    async def _select(self, model_id: str) -> bool:
        with translated("trainer SelectModel"):
            return await self.trainer.select_model(model_id, timeout=self.config.trainer_timeout_seconds)

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
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await self.models.close()

    # -- service -------------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.base_model, "trainable": True,
                                      "sampleable": self.sampler is not None}]}

    def create_session(self) -> str:
        return self.sessions.create().session_id

    # -- models --------------------------------------------------------------

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown(body, {"session_id", "model_seq_id", "base_model", "user_metadata", "lora_config",
                               "optimizer_config"}, "create_model")
        session = self.sessions.live(str(body.get("session_id", "")))
        seq = body.get("model_seq_id")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise InvalidArgument(f"create_model: model_seq_id must be an integer >= 0, got {seq!r}")
        key = (session.session_id, seq)
        model_id = f"{session.session_id}:train:{seq}"
        if key in self._created:  # sent again
            return {"request_id": self._created[key], "model_id": model_id}
        request_id = self.futures.new("create_model")
        self._created[key] = request_id

        async def create() -> Outcome:
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
                rank = 0
            else:
                _refuse_unknown(lora, {"rank", "seed", *LORA_MODULES}, "lora_config")
                if lora.get("seed") is not None:
                    raise InvalidArgument("lora_config.seed: the adapters are initialised when the trainer starts "
                                          "(its model.seed); a per-model seed is not served")
                rank = int(lora.get("rank", 0))
                check_lora(rank, {k: bool(lora.get(k, True)) for k in LORA_MODULES}, self.lora_rank,
                           self.lora_modules)
            metadata = body.get("user_metadata") or {}
            if not isinstance(metadata, dict):
                raise InvalidArgument("create_model: user_metadata must be an object")
            await self._create(TrainingModel(model_id, session.session_id, self.base_model, rank, metadata), None)
            return Outcome(json={"type": "create_model", "model_id": model_id})

        self.futures.run(request_id, create)
        return {"request_id": request_id, "model_id": model_id}

    async def _create(self, model: TrainingModel, load: str | None) -> None:
        """Creates `model` on the trainer from the adapters' initialisation, or from checkpoint `load`."""
        for ended in [m for m in self.models.training() if not self._session_runs(m.session_id)]:
            await self.models.retire(ended, f"its session ended ({self.sessions.get(ended.session_id).ended})")
        async with self.models.turn(model.model_id, new=True):
            if load is not None:
                try:
                    with translated("trainer LoadCheckpoint"):
                        await self.trainer.load_checkpoint(load, timeout=self.config.trainer_timeout_seconds)
                except BaseException:
                    await self._select("")
                    await self._drop(model.model_id)
                    raise
            self.models.add(model)
        self._write_run(model)

    def _session_runs(self, session_id: str) -> bool:
        try:
            self.sessions.live(session_id)
        except FailedPrecondition:
            return False
        return True

    def finish_session(self, session_id: str, reason: str, detail: str | None) -> None:
        """Ends the session (the first reason stays) and drops its models from the trainer, in the
        background: a drop waits for the trainer's turn, which a long request may hold."""
        session = self.sessions.finish(session_id, reason, detail)
        for model in self.models.of_session(session_id):
            task = asyncio.create_task(self.models.retire(model, f"its session finished ({session.ended})"))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    def _write_run(self, model: TrainingModel) -> None:
        directory = self.config.checkpoint_dir / model.model_id
        directory.mkdir(parents=True, exist_ok=True)
        record = {"training_run_id": model.model_id, "base_model": model.base_model, "lora_rank": model.lora_rank,
                  "user_metadata": model.user_metadata, "created": time.time()}
        (directory / _RUN_RECORD).write_text(json.dumps(record))

    def _read_run(self, model_id: str) -> dict[str, Any]:
        try:
            return json.loads((self.config.checkpoint_dir / model_id / _RUN_RECORD).read_text())
        except (OSError, ValueError):
            raise NotFound(f"training run {model_id!r} is not known here") from None

    def training_run(self, model_id: str) -> dict[str, Any]:
        run = self._read_run(model_id)
        listed = self.checkpoints(model_id)["checkpoints"]
        last = listed[-1] if listed else None
        return {
            "training_run_id": model_id, "base_model": run["base_model"], "model_owner": "flywheel",
            "is_lora": run["lora_rank"] > 0, "lora_rank": run["lora_rank"] or None,
            "last_request_time": last["time"] if last else _iso(run["created"]),
            "user_metadata": run.get("user_metadata") or None, "corrupted": False,
            "last_checkpoint": last, "last_sampler_checkpoint": None,
        }

    def checkpoints(self, model_id: str) -> dict[str, Any]:
        self._read_run(model_id)  # NotFound for a run this gateway never made
        records = []
        for record_file in (self.config.checkpoint_dir / model_id).glob(f"*/{_CHECKPOINT_RECORD}"):
            try:
                records.append(json.loads(record_file.read_text()))
            except (OSError, ValueError):
                continue
        records.sort(key=lambda r: r.get("created", 0))
        return {"checkpoints": [_checkpoint_json(model_id, r) for r in records]}

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create-via-load (session_id + model_seq_id: a new model from a checkpoint) or a load into
        the model (model_id + seq_id, in its order)."""
        _refuse_unknown(body, {"model_id", "seq_id", "session_id", "model_seq_id", "base_model", "user_metadata",
                               "path", "optimizer", "optimizer_config", "weights_access_token"}, "load_weights")
        path = str(body.get("path", ""))
        if body.get("weights_access_token"):
            raise InvalidArgument("load_weights: weights_access_token is not served (one deployment, one owner)")

        def checkpoint() -> tuple[str, dict[str, Any]]:
            if not body.get("optimizer"):
                raise InvalidArgument("load_weights: weights without their optimizer state are not served yet; "
                                      "load with the optimizer (load_state_with_optimizer)")
            if body.get("optimizer_config") not in (None, {"type": "adamw"}):
                raise InvalidArgument(f"load_weights: only adamw is served, got {body['optimizer_config']!r}")
            match = _PATH.match(path)
            if match is None or match["kind"] != "weights":
                raise InvalidArgument(f"load_weights: path {path!r} is not a tinker://<model>/weights/<name> path")
            try:
                record = json.loads((self._checkpoint_dir(match["model"], match["name"]) / _CHECKPOINT_RECORD)
                                    .read_text())
            except (OSError, ValueError):
                raise NotFound(f"load_weights: no checkpoint {path!r} here") from None
            return record["trainer_path"], self._read_run(match["model"])

        if body.get("session_id") is not None:
            session = self.sessions.live(str(body["session_id"]))
            seq = body.get("model_seq_id")
            if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
                raise InvalidArgument(f"load_weights: model_seq_id must be an integer >= 0, got {seq!r}")
            key = (session.session_id, seq)
            model_id = f"{session.session_id}:train:{seq}"
            if key in self._created:
                return {"request_id": self._created[key], "model_id": model_id}
            request_id = self.futures.new("load_weights")
            self._created[key] = request_id

            async def create() -> Outcome:
                trainer_path, run = checkpoint()
                base = body.get("base_model") or run["base_model"]
                if base != self.base_model:
                    raise NotFound(f"base_model {base!r} is not served here; this gateway serves {self.base_model!r}")
                metadata = body.get("user_metadata") or run.get("user_metadata") or {}
                await self._create(
                    TrainingModel(model_id, session.session_id, base, int(run["lora_rank"]), metadata), trainer_path)
                return Outcome(json={"type": "load_weights", "path": path, "model_id": model_id})

            self.futures.run(request_id, create)
            return {"request_id": request_id, "model_id": model_id}

        model = self.models.get(str(body.get("model_id", "")))
        self.sessions.live(model.session_id)

        async def load() -> Outcome:
            trainer_path, run = checkpoint()
            if int(run["lora_rank"]) != model.lora_rank:
                raise InvalidArgument(f"load_weights: {path} has LoRA rank {run['lora_rank']}, the model "
                                      f"{model.lora_rank}")
            with translated("trainer LoadCheckpoint"):
                await self.trainer.load_checkpoint(trainer_path, timeout=self.config.trainer_timeout_seconds)
            return Outcome(json={"type": "load_weights", "path": path, "model_id": model.model_id})

        return {"request_id": self.models.submit(model.model_id, body.get("seq_id"), "load_weights", load),
                "model_id": model.model_id}

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self.models.get(str(body.get("model_id", "")))
        return {
            "type": "get_info", "model_id": model.model_id, "model_name": model.base_model,
            # The tokenizer is the base model's: a local model directory loads without a hub.
            "model_data": {"model_name": model.base_model, "tokenizer_id": model.base_model},
            "is_lora": model.lora_rank > 0, "lora_rank": model.lora_rank or None,
            "optimizer_config": {"type": "adamw"},
        }

    # -- training ------------------------------------------------------------

    def forward_backward(self, request) -> dict[str, Any]:
        """`request`: the SDK's tinker.proto ForwardBackwardRequest."""
        model = self.models.get(request.model_id)
        self.sessions.live(model.session_id)
        timeout = self.config.trainer_timeout_seconds

        async def run() -> Outcome:
            call = trainer_call(request)
            with translated("trainer ForwardBackward"):
                result = await self.trainer.forward_backward(call.batch, call.loss, forward_only=call.forward_only,
                                                             timeout=timeout)
            return Outcome(proto=forward_backward_output(result, call.lengths))

        label = "forward" if request.forward_only else "forward_backward"
        return {"request_id": self.models.submit(model.model_id, request.seq_id, label, run),
                "model_id": model.model_id}

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self.models.get(str(body.get("model_id", "")))
        self.sessions.live(model.session_id)

        async def run() -> Outcome:
            _refuse_unknown(body, {"model_id", "seq_id", "adam_params", "optimizer_params"}, "optim_step")
            adam = adam_step(body)
            with translated("trainer OptimStep"):
                result = await self.trainer.optim_step(adam=adam, timeout=self.config.trainer_timeout_seconds)
            return Outcome(json={"type": "optim_step", "metrics": {
                "grad_norm:mean": result.grad_norm, "learning_rate:mean": result.learning_rate,
                "step:max": float(result.step)}})

        return {"request_id": self.models.submit(model.model_id, body.get("seq_id"), "optim_step", run),
                "model_id": model.model_id}

    # -- checkpoints ---------------------------------------------------------

    def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self.models.get(str(body.get("model_id", "")))
        self.sessions.live(model.session_id)

        async def run() -> Outcome:
            _refuse_unknown(body, {"model_id", "seq_id", "path", "ttl_seconds", "overwrite", "user_metadata"},
                            "save_weights")
            name = body.get("path") or f"step-{model.next_seq - 1}"
            if not isinstance(name, str) or not _NAME.match(name):
                raise InvalidArgument(f"save_weights: path {name!r} must be a name of letters, digits, '.', '_', '-'")
            ttl, metadata = _ttl_and_metadata(body, "save_weights")
            self._remove_expired()
            target = self._checkpoint_dir(model.model_id, name)
            if target.exists():
                if not body.get("overwrite"):
                    raise AlreadyExists(f"save_weights: {name!r} exists for model {model.model_id}; "
                                        "pass overwrite=True to replace it")
                shutil.rmtree(target)
            with translated("trainer SaveCheckpoint"):
                saved = await self.trainer.save_checkpoint(str(target), timeout=self.config.trainer_timeout_seconds)
            now = time.time()
            record = {"name": name, "trainer_path": saved.path, "step": saved.step, "created": now,
                      "expires": None if ttl is None else now + ttl, "user_metadata": metadata}
            (target / _CHECKPOINT_RECORD).write_text(json.dumps(record))
            return Outcome(json={"type": "save_weights", "path": f"tinker://{model.model_id}/weights/{name}"})

        return {"request_id": self.models.submit(model.model_id, body.get("seq_id"), "save_weights", run),
                "model_id": model.model_id}

    def _checkpoint_dir(self, model_id: str, name: str) -> Path:
        return self.config.checkpoint_dir / model_id / name

    def _remove_expired(self) -> None:
        """Removes the named saves and the sampler versions whose time to live is over."""
        now = time.time()
        records = [*self.config.checkpoint_dir.glob(f"*/*/{_CHECKPOINT_RECORD}"),
                   *self.config.sampler_dir.glob(f"*/*/{_CHECKPOINT_RECORD}")]
        for record_file in records:
            try:
                expires = json.loads(record_file.read_text()).get("expires")
            except (OSError, ValueError):
                continue
            if expires is not None and expires < now:
                shutil.rmtree(record_file.parent, ignore_errors=True)
                log.info("checkpoint expired and removed", extra={"path": str(record_file.parent)})

    # -- sampling ------------------------------------------------------------

    def _require_sampler(self) -> Sampler:
        if self.sampler is None:
            raise FailedPrecondition("sampling is not served by this gateway (no rollout_address configured)")
        return self.sampler

    def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self.models.get(str(body.get("model_id", "")))
        session = self.sessions.live(model.session_id)

        async def run() -> Outcome:
            _refuse_unknown(body, {"model_id", "seq_id", "path", "sampling_session_seq_id", "kind", "ttl_seconds",
                                   "user_metadata"}, "save_weights_for_sampler")
            sampler = self._require_sampler()
            name, kind = body.get("path"), body.get("kind", "snapshot")
            if kind not in ("snapshot", "inflight"):
                raise InvalidArgument(f"save_weights_for_sampler: kind must be snapshot or inflight, got {kind!r}")
            if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
                raise InvalidArgument(f"save_weights_for_sampler: path {name!r} must be a name of letters, digits, "
                                      "'.', '_', '-'")
            if name is None and body.get("sampling_session_seq_id") is None:
                raise InvalidArgument("save_weights_for_sampler: give a path (a name) or a sampling_session_seq_id")
            ttl, metadata = _ttl_and_metadata(body, "save_weights_for_sampler")
            self._remove_expired()
            if name is not None and (model.model_id, name) in self._sampler_weights:
                raise AlreadyExists(f"save_weights_for_sampler: {name!r} exists for model {model.model_id}")
            timeout = self.config.trainer_timeout_seconds
            with translated("trainer GetInfo"):
                version = int((await self.trainer.get_info(timeout=timeout)).weight_version)
            if version:  # version 0 is the base model the replica started with: nothing to export
                with translated("trainer ExportWeights"):
                    exported = await self.trainer.export_weights(
                        "checkpoint", directory=str(self.config.sampler_dir / model.model_id), timeout=timeout)
                version = int(exported.weight_version)
                now = time.time()
                record = {"name": name, "version": version, "created": now,
                          "expires": None if ttl is None else now + ttl, "user_metadata": metadata}
                (Path(exported.path) / _CHECKPOINT_RECORD).write_text(json.dumps(record))
                await sampler.install(model.model_id, version, exported.path)
            if name is not None:
                self._sampler_weights[(model.model_id, name)] = version
                return Outcome(json={"type": "save_weights_for_sampler",
                                     "path": f"tinker://{model.model_id}/sampler_weights/{name}"})
            sampling = self._new_sampling_session(session.session_id, int(body["sampling_session_seq_id"]), version,
                                                  kind == "snapshot", None, model.model_id)
            return Outcome(json={"type": "save_weights_for_sampler", "sampling_session_id": sampling})

        return {"request_id": self.models.submit(model.model_id, body.get("seq_id"), "save_weights_for_sampler", run),
                "model_id": model.model_id}

    def _new_sampling_session(self, session_id: str, seq: int, version: int, exact: bool,
                              model_path: str | None, model_id: str | None) -> str:
        key = (session_id, seq)
        if key in self._sampling_created:
            return self._sampling_created[key]
        sampling_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[sampling_id] = SamplingSession(session_id, sampling_id, version, exact, model_path,
                                                              model_id)
        self._sampling_created[key] = sampling_id
        return sampling_id

    def _sampler_version(self, model_path: str) -> tuple[str, int]:
        match = _PATH.match(model_path)
        if match is None:
            raise InvalidArgument(f"model_path {model_path!r} is not a tinker://<model>/sampler_weights/<name> path")
        if match["kind"] != "sampler_weights":
            raise InvalidArgument(f"model_path {model_path!r}: training checkpoints (weights/) are not sampled "
                                  "from; save_weights_for_sampler makes weights to sample")
        version = self._sampler_weights.get((match["model"], match["name"]))
        if version is None:
            raise NotFound(f"model_path {model_path!r}: no such sampler weights here")
        return match["model"], version

    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown(body, {"session_id", "sampling_session_seq_id", "base_model", "model_path"},
                        "create_sampling_session")
        self._require_sampler()
        session = self.sessions.live(str(body.get("session_id", "")))
        seq = body.get("sampling_session_seq_id")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise InvalidArgument(f"sampling_session_seq_id must be an integer >= 0, got {seq!r}")
        model_path, base = body.get("model_path"), body.get("base_model")
        if model_path is not None:
            model_id, version = self._sampler_version(str(model_path))
        elif base == self.base_model:
            model_id, version = None, 0
        else:
            raise NotFound(f"base_model {base!r} is not served here; this gateway serves {self.base_model!r}")
        sampling_id = self._new_sampling_session(session.session_id, seq, version, True, model_path, model_id)
        return {"type": "create_sampling_session", "sampling_session_id": sampling_id}

    def get_sampler(self, sampling_session_id: str) -> dict[str, Any]:
        sampling = self.sampling_sessions.get(sampling_session_id)
        if sampling is None:
            raise NotFound(f"sampler {sampling_session_id!r} is not known here")
        return {"sampler_id": sampling_session_id, "base_model": self.base_model, "model_path": sampling.model_path}

    def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        sampler = self._require_sampler()
        sampling_id = body.get("sampling_session_id")
        if sampling_id is None:
            raise InvalidArgument("asample: sampling_session_id is needed (the SDK's sampling clients send it)")
        sampling = self.sampling_sessions.get(str(sampling_id))
        if sampling is None:
            raise NotFound(f"sampler {sampling_id!r} is not known here")
        self.sessions.live(sampling.session_id)
        seq = body.get("seq_id")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise InvalidArgument(f"asample: seq_id must be an integer, got {seq!r}")
        known = self._samples.get((sampling.sampling_session_id, seq))
        if known is not None:
            return known[1]  # sent again: the first one's answer
        plan = sample_plan(body)  # a malformed request is answered now, before it is accepted
        request_id = self.futures.new("sample")

        async def run() -> Outcome:
            samples = await sampler.sample(plan, sampling.model_id, sampling.version, sampling.exact)
            return Outcome(proto=sample_response(samples, plan))

        self.futures.run(request_id, run)
        answer = {"request_id": request_id,
                  "sample_sequence_ids": [f"{request_id}:{i}" for i in range(plan.num_samples)]}
        now = time.monotonic()
        for key in [k for k, (at, _) in self._samples.items() if at < now - self.futures.keep_seconds]:
            del self._samples[key]
        self._samples[(sampling.sampling_session_id, seq)] = (now, answer)
        return answer
