"""The SDK's RestClient calls: training runs, checkpoints (list, delete, time to
live, weights info) and sessions, each answered from the caller's tenant's
own runs and saves only (services/tinker/checkpoints.py): another tenant's
are 404, as unknown ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flywheel.errors import InvalidArgument
from services.tinker.checkpoints import check_ttl, iso
from services.tinker.models import LORA_MODULES
from services.tinker.paths import parse_checkpoint_id, parse_path

if TYPE_CHECKING:
    from services.tinker.gateway import Gateway

#: The most items one page of a list holds.
MAX_PAGE = 1000


def _page(items: list, limit: object, offset: object) -> tuple[list, dict[str, int]]:
    try:
        limit, offset = int(limit), int(offset)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgument(f"limit and offset must be integers, got {limit!r}, {offset!r}") from None
    if not 1 <= limit <= MAX_PAGE or offset < 0:
        raise InvalidArgument(f"limit must be 1..{MAX_PAGE} and offset >= 0, got {limit}, {offset}")
    return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


class Rest:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.checkpoints = gateway.checkpoints

    def training_run(self, tenant: str, model_id: str) -> dict[str, Any]:
        run = self.checkpoints.read_run(tenant, model_id)
        listed = self.checkpoints.listed(tenant, model_id)
        training = [c for c in listed if c["checkpoint_type"] == "training"]
        sampler = [c for c in listed if c["checkpoint_type"] == "sampler"]
        last = listed[-1] if listed else None
        return {
            "training_run_id": model_id, "base_model": run["base_model"], "model_owner": tenant,
            "is_lora": run["lora_rank"] > 0, "lora_rank": run["lora_rank"] or None,
            "last_request_time": last["time"] if last else iso(run["created"]),
            "user_metadata": run.get("user_metadata") or None, "corrupted": False,
            "last_checkpoint": training[-1] if training else None,
            "last_sampler_checkpoint": sampler[-1] if sampler else None,
        }

    def training_runs(self, tenant: str, limit: object = 20, offset: object = 0) -> dict[str, Any]:
        runs = [r["training_run_id"] for r in self.checkpoints.runs(tenant)]
        page, cursor = _page(runs, limit, offset)
        return {"training_runs": [self.training_run(tenant, model_id) for model_id in page], "cursor": cursor}

    def checkpoints_of(self, tenant: str, model_id: str) -> dict[str, Any]:
        return {"checkpoints": self.checkpoints.listed(tenant, model_id)}

    def user_checkpoints(self, tenant: str, limit: object = 100, offset: object = 0) -> dict[str, Any]:
        every = [c for run in self.checkpoints.runs(tenant)
                 for c in self.checkpoints.listed(tenant, run["training_run_id"])]
        every.sort(key=lambda c: c["time"], reverse=True)  # newest first, as Tinker lists them
        page, cursor = _page(every, limit, offset)
        return {"checkpoints": page, "cursor": cursor}

    async def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        path = parse_checkpoint_id(model_id, checkpoint_id, "delete checkpoint")
        self.checkpoints.read_run(tenant, path.model_id)
        if path.kind == "weights":
            self.checkpoints.delete_training(tenant, path)
        else:
            await self.gateway.sampling.delete(tenant, path)

    def set_ttl(self, tenant: str, model_id: str, checkpoint_id: str, body: dict[str, Any]) -> None:
        path = parse_checkpoint_id(model_id, checkpoint_id, "checkpoint ttl")
        self.checkpoints.read_run(tenant, path.model_id)
        self.checkpoints.set_ttl(tenant, path, check_ttl(body.get("ttl_seconds"), "checkpoint ttl"))

    def weights_info(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        path = parse_path(body.get("tinker_path"), "weights_info: tinker_path")
        run = self.checkpoints.read_run(tenant, path.model_id)
        if path.kind == "weights":
            self.checkpoints.training_record(tenant, path)
        else:
            self.checkpoints.sampler_save(tenant, path)
        modules = set(self.gateway.lora_modules)
        if "all-linear" in modules:
            modules |= LORA_MODULES["train_attn"] | LORA_MODULES["train_mlp"]
        lora = run["lora_rank"] > 0
        flags = {flag: (names <= modules) if lora else None for flag, names in LORA_MODULES.items()}
        return {"base_model": run["base_model"], "optimizer_config": {"type": "adamw"}, "is_lora": lora,
                "lora_rank": run["lora_rank"] or None, **flags}

    def session(self, tenant: str, session_id: str) -> dict[str, Any]:
        session = self.gateway.sessions.get(session_id, tenant)
        models = [m.model_id for m in self.gateway.models.of_tenant(tenant) if m.session_id == session_id]
        return {"training_run_ids": models, "sampler_ids": self.gateway.sampling.of_session(session_id),
                "user_metadata": session.user_metadata or None, "display_name": None}

    def sessions(self, tenant: str, limit: object = 20, offset: object = 0) -> dict[str, Any]:
        ids = [s.session_id for s in sorted(self.gateway.sessions.of_tenant(tenant), key=lambda s: s.created,
                                            reverse=True)]
        return {"sessions": _page(ids, limit, offset)[0]}
