"""Tinker's sampling calls: saves for the sampler, sampling sessions and samples.

`save_weights_for_sampler` exports the model's weights as a version of its
own (services/tinker/sampler.py: (model, version, identity)) and makes a
sampling session pinned to it, or names it `tinker://<model id>/sampler_weights/
<name>`. A sampling session belongs to its session's tenant: another tenant
does not find it, nor the named weights (their path is looked up among the
caller's own). Named versions survive a gateway restart (read back from their
records at start); unnamed ones are removed then, as a model's past its last
`sampler_keep_unnamed` are at each save.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from flywheel.runtime.client import translated
from services.tinker.bodies import refuse_unknown
from services.tinker.checkpoints import RECORD, ttl_and_metadata, write_json
from services.tinker.futures import Outcome
from services.tinker.paths import TinkerPath, check_name
from services.tinker.sampler import BASE, Sampler, SamplerVersion
from services.tinker.sampling import sample_plan, sample_response

if TYPE_CHECKING:
    from services.tinker.gateway import Gateway

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSession:
    session_id: str
    tenant: str
    sampling_session_id: str
    #: The weights it samples: exactly (snapshot) or at least (inflight: then its model's newest).
    weights: SamplerVersion
    exact: bool
    model_path: str | None


class SamplingSessions:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._sessions: dict[str, SamplingSession] = {}
        # (sampling session, seq_id) -> its answer, as long as its result is kept (a resend gets the same).
        self._samples: dict[tuple[str, int], tuple[float, dict[str, Any]]] = {}
        self._created: dict[tuple[str, int], str] = {}  # (session, sampling_session_seq_id) -> its id

    def _require_sampler(self) -> Sampler:
        if self.gateway.sampler is None:
            raise FailedPrecondition("sampling is not served by this gateway (no rollout_address configured)")
        return self.gateway.sampler

    def adopt_saved(self) -> None:
        """At start: named sampler saves of earlier lives are sampled again by path; unnamed ones removed."""
        sampler = self.gateway.sampler
        for tenant, model_id, directory, record in list(self.gateway.checkpoints.sampler_saves()):
            if record.get("name") and sampler is not None and record.get("identity"):
                sampler.adopt(SamplerVersion(tenant, model_id, int(record["version"]),
                                             bytes.fromhex(record["identity"]), str(directory), record["name"],
                                             adapter=bool(record.get("adapter"))))
            else:
                shutil.rmtree(directory.parent, ignore_errors=True)

    def forget(self, session_ids: set[str]) -> None:
        """Forgets the sampling sessions of `session_ids` and what was kept for them."""
        gone = {sid for sid, s in self._sessions.items() if s.session_id in session_ids}
        for sid in gone:
            del self._sessions[sid]
        for key in [k for k in self._created if k[0] in session_ids]:
            del self._created[key]
        for key in [k for k in self._samples if k[0] in gone]:
            del self._samples[key]

    def held(self) -> int:
        return len(self._sessions) + len(self._samples) + len(self._created)

    # -- saves ---------------------------------------------------------------

    def save_weights_for_sampler(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        gateway = self.gateway
        model = gateway.live_model(tenant, str(body.get("model_id", "")))
        session = gateway.sessions.live(model.session_id, tenant)

        async def run() -> Outcome:
            refuse_unknown(body, {"model_id", "seq_id", "path", "sampling_session_seq_id", "kind", "ttl_seconds",
                                  "user_metadata"}, "save_weights_for_sampler")
            sampler = self._require_sampler()
            name, kind = body.get("path"), body.get("kind", "snapshot")
            if kind not in ("snapshot", "inflight"):
                raise InvalidArgument(f"save_weights_for_sampler: kind must be snapshot or inflight, got {kind!r}")
            if name is not None:
                check_name(name, "save_weights_for_sampler: path")
            if name is None and body.get("sampling_session_seq_id") is None:
                raise InvalidArgument("save_weights_for_sampler: give a path (a name) or a sampling_session_seq_id")
            ttl, metadata = ttl_and_metadata(body, "save_weights_for_sampler")
            await self.remove_expired()
            if name is not None and sampler.named(tenant, model.model_id, name) is not None:
                raise AlreadyExists(f"save_weights_for_sampler: {name!r} exists for model {model.model_id}")
            timeout = gateway.config.trainer_timeout_seconds
            with translated("trainer GetInfo"):
                version = int((await gateway.trainer.get_info(timeout=timeout)).weight_version)
            weights = BASE
            if version:  # version 0 is the base model the replica started with: nothing to export
                parent = gateway.checkpoints.sampler_model_dir(tenant, model.model_id) / f"save-{uuid.uuid4().hex[:12]}"
                with translated("trainer ExportWeights"):
                    exported = await gateway.trainer.export_weights("checkpoint", directory=str(parent),
                                                                    merge_lora=not sampler.adapters, timeout=timeout)
                if not exported.identity:
                    raise FailedPrecondition("the trainer exported weights without an identity (no weight manifest)")
                weights = SamplerVersion(tenant, model.model_id, int(exported.weight_version), exported.identity,
                                         exported.path, name, adapter=sampler.adapters)
                now = time.time()
                write_json(Path(exported.path) / RECORD, {
                    "name": name, "version": weights.version, "identity": weights.identity.hex(),
                    "adapter": weights.adapter, "created": now,
                    "expires": None if ttl is None else now + ttl, "user_metadata": metadata})
                try:
                    await sampler.install(weights)
                finally:
                    gateway.checkpoints.measure(tenant)
            elif name is not None:
                raise FailedPrecondition("save_weights_for_sampler: the model has not trained yet (its weights are "
                                         "the base model's); a name is given to trained weights only")
            if name is not None:
                return Outcome(json={"type": "save_weights_for_sampler",
                                     "path": str(TinkerPath(model.model_id, "sampler_weights", name))})
            sampling = self._new(session.session_id, tenant, int(body["sampling_session_seq_id"]), weights,
                                 kind == "snapshot", None)
            return Outcome(json={"type": "save_weights_for_sampler", "sampling_session_id": sampling})

        return {"request_id": gateway.models.submit(model.model_id, tenant, body.get("seq_id"),
                                                    "save_weights_for_sampler", run),
                "model_id": model.model_id}

    async def remove_expired(self) -> None:
        sampler = self.gateway.sampler
        if sampler is None:
            return
        for tenant, directory, record in list(self.gateway.checkpoints.expired()):
            if not directory.is_relative_to(self.gateway.checkpoints.sampler_dir):
                continue
            model_id = directory.relative_to(self.gateway.checkpoints.sampler_dir).parts[1]
            held = [w for w in sampler.of_model(model_id) if w.checkpoint == str(directory)]
            for weights in held:
                await sampler.remove(weights, "expired")
            if not held:
                shutil.rmtree(directory.parent, ignore_errors=True)
            self.gateway.checkpoints.measure(tenant)

    async def delete(self, tenant: str, path: TinkerPath) -> None:
        sampler = self._require_sampler()
        weights = sampler.named(tenant, path.model_id, path.name)
        if weights is None:
            raise NotFound(f"no sampler weights {str(path)!r} here")
        await sampler.remove(weights, "deleted")
        self.gateway.checkpoints.measure(tenant)

    # -- sampling sessions -------------------------------------------------------

    def _new(self, session_id: str, tenant: str, seq: int, weights: SamplerVersion, exact: bool,
             model_path: str | None) -> str:
        key = (session_id, seq)
        if key in self._created:
            return self._created[key]
        sampling_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self._sessions[sampling_id] = SamplingSession(session_id, tenant, sampling_id, weights, exact, model_path)
        self._created[key] = sampling_id
        return sampling_id

    def _get(self, tenant: str, sampling_session_id: object) -> SamplingSession:
        sampling = self._sessions.get(str(sampling_session_id))
        if sampling is None or sampling.tenant != tenant:
            raise NotFound(f"sampler {sampling_session_id!r} is not known here")
        return sampling

    def of_session(self, session_id: str) -> list[str]:
        return [sid for sid, s in self._sessions.items() if s.session_id == session_id]

    def create_sampling_session(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        refuse_unknown(body, {"session_id", "sampling_session_seq_id", "base_model", "model_path"},
                       "create_sampling_session")
        sampler = self._require_sampler()
        session = self.gateway.sessions.live(str(body.get("session_id", "")), tenant)
        seq = body.get("sampling_session_seq_id")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise InvalidArgument(f"sampling_session_seq_id must be an integer >= 0, got {seq!r}")
        model_path, base = body.get("model_path"), body.get("base_model")
        if model_path is not None:
            path = self.gateway.checkpoints.resolve(tenant, model_path, "model_path", ("sampler_weights",))
            weights = sampler.named(tenant, path.model_id, path.name)
            if weights is None:
                raise NotFound(f"model_path {model_path!r}: no such sampler weights here")
        elif base == self.gateway.base_model:
            weights = BASE
        else:
            raise NotFound(f"base_model {base!r} is not served here; this gateway serves "
                           f"{self.gateway.base_model!r}")
        sampling_id = self._new(session.session_id, tenant, seq, weights, True, model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampling_id}

    def get_sampler(self, tenant: str, sampling_session_id: str) -> dict[str, Any]:
        sampling = self._get(tenant, sampling_session_id)
        return {"sampler_id": sampling_session_id, "base_model": self.gateway.base_model,
                "model_path": sampling.model_path}

    def asample(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        sampler = self._require_sampler()
        sampling_id = body.get("sampling_session_id")
        if sampling_id is None:
            raise InvalidArgument("asample: sampling_session_id is needed (the SDK's sampling clients send it)")
        sampling = self._get(tenant, sampling_id)
        self.gateway.sessions.live(sampling.session_id, tenant)
        seq = body.get("seq_id")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise InvalidArgument(f"asample: seq_id must be an integer, got {seq!r}")
        known = self._samples.get((sampling.sampling_session_id, seq))
        if known is not None:
            return known[1]  # sent again: the first one's answer
        plan = sample_plan(body)  # a malformed request is answered now, before it is accepted
        futures = self.gateway.futures
        request_id = futures.new("sample", tenant)

        async def run() -> Outcome:
            samples = await sampler.sample(plan, sampling.weights, sampling.exact)
            return Outcome(proto=sample_response(samples, plan))

        futures.run(request_id, run)
        answer = {"request_id": request_id,
                  "sample_sequence_ids": [f"{request_id}:{i}" for i in range(plan.num_samples)]}
        now = time.monotonic()
        for key in [k for k, (at, _) in self._samples.items() if at < now - futures.keep_seconds]:
            del self._samples[key]
        self._samples[(sampling.sampling_session_id, seq)] = (now, answer)
        return answer
