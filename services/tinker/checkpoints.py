"""Where a tenant's training runs and saves live on disk, and the REST calls on them.

    checkpoint_dir/<tenant>/<model id>/run.json            a training run (what GET training_runs/{id} says)
    checkpoint_dir/<tenant>/<model id>/<name>/             a named save (the trainer writes it) + tinker.json
    sampler_dir/<tenant>/<model id>/save-<id>/version_<N>/ weights saved for the sampler + tinker.json

Everything is looked up under the caller's tenant's directory only: another
tenant's run or save is not found (404) by id and by path alike, and the
paths themselves are parsed strictly first (services/tinker/paths.py).
`tinker.json` holds the save's name, its expiry (`ttl_seconds`; None: never),
the caller's metadata and, for sampler saves, the weights' identity. Expired
saves are removed at the next save; DELETE removes one at once. The bytes a
tenant holds here are its `flywheel_tinker_tenant_disk_bytes`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flywheel.errors import InvalidArgument, NotFound
from services.tinker import metrics
from services.tinker.paths import TinkerPath, check_model_id, parse_path

log = logging.getLogger(__name__)

RECORD = "tinker.json"
RUN = "run.json"
#: Tinker's bounds on a checkpoint's time to live: an hour to ten years (None: never expires).
TTL_RANGE = (3600, 10 * 365 * 24 * 3600)


def iso(unix_seconds: float) -> str:
    return datetime.fromtimestamp(unix_seconds, timezone.utc).isoformat()


def check_ttl(ttl: object, what: str) -> int | None:
    if ttl is not None and not (isinstance(ttl, int) and not isinstance(ttl, bool)
                                and TTL_RANGE[0] <= ttl <= TTL_RANGE[1]):
        raise InvalidArgument(f"{what}: ttl_seconds must be {TTL_RANGE[0]}..{TTL_RANGE[1]} or null, got {ttl!r}")
    return ttl


def ttl_and_metadata(body: dict[str, Any], what: str) -> tuple[int | None, dict[str, str]]:
    """A save's time to live (None: it never expires) and the caller's metadata, checked."""
    ttl = check_ttl(body.get("ttl_seconds"), what)
    metadata = body.get("user_metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidArgument(f"{what}: user_metadata must map names to strings")
    return ttl, metadata


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def disk_bytes(*roots: Path) -> int:
    total = 0
    for root in roots:
        for folder, _, files in os.walk(root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    continue
    return total


class Checkpoints:
    """A gateway's runs and saves on disk, by tenant (see the module doc)."""

    def __init__(self, checkpoint_dir: Path, sampler_dir: Path) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.sampler_dir = sampler_dir

    # -- where things are -------------------------------------------------

    def run_dir(self, tenant: str, model_id: str) -> Path:
        return self.checkpoint_dir / tenant / model_id

    def save_dir(self, tenant: str, path: TinkerPath) -> Path:
        """A named training save's directory (which may not exist)."""
        return self.run_dir(tenant, path.model_id) / path.name

    def sampler_model_dir(self, tenant: str, model_id: str) -> Path:
        return self.sampler_dir / tenant / model_id

    # -- runs ---------------------------------------------------------------

    def write_run(self, tenant: str, model_id: str, record: dict[str, Any]) -> None:
        directory = self.run_dir(tenant, model_id)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / RUN, {**record, "training_run_id": model_id, "created": time.time()})

    def read_run(self, tenant: str, model_id: str) -> dict[str, Any]:
        check_model_id(model_id, "training run")
        run = read_json(self.run_dir(tenant, model_id) / RUN)
        if run is None:
            raise NotFound(f"training run {model_id!r} is not known here")
        return run

    def runs(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's runs, oldest first."""
        found = [read_json(p) for p in (self.checkpoint_dir / tenant).glob(f"*/{RUN}")]
        return sorted((r for r in found if r is not None), key=lambda r: r.get("created", 0))

    # -- saves --------------------------------------------------------------

    def training_record(self, tenant: str, path: TinkerPath) -> dict[str, Any]:
        record = read_json(self.save_dir(tenant, path) / RECORD)
        if record is None:
            raise NotFound(f"no checkpoint {str(path)!r} here")
        return record

    def sampler_records(self, tenant: str, model_id: str) -> Iterator[tuple[Path, dict[str, Any]]]:
        """The model's sampler saves: (directory, record)."""
        for record_file in self.sampler_model_dir(tenant, model_id).glob(f"save-*/version_*/{RECORD}"):
            record = read_json(record_file)
            if record is not None:
                yield record_file.parent, record

    def sampler_save(self, tenant: str, path: TinkerPath) -> tuple[Path, dict[str, Any]]:
        for directory, record in self.sampler_records(tenant, path.model_id):
            if record.get("name") == path.name:
                return directory, record
        raise NotFound(f"no sampler weights {str(path)!r} here")

    def listed(self, tenant: str, model_id: str) -> list[dict[str, Any]]:
        """The run's named saves, training and sampler, oldest first, as the SDK's Checkpoint objects."""
        self.read_run(tenant, model_id)
        out = []
        for record_file in self.run_dir(tenant, model_id).glob(f"*/{RECORD}"):
            record = read_json(record_file)
            if record is not None:
                out.append(self._checkpoint(TinkerPath(model_id, "weights", record["name"]), record,
                                            record_file.parent))
        for directory, record in self.sampler_records(tenant, model_id):
            if record.get("name"):
                out.append(self._checkpoint(TinkerPath(model_id, "sampler_weights", record["name"]), record,
                                            directory))
        return sorted(out, key=lambda c: c["time"])

    @staticmethod
    def _checkpoint(path: TinkerPath, record: dict[str, Any], directory: Path) -> dict[str, Any]:
        expires = record.get("expires")
        return {"checkpoint_id": path.checkpoint_id,
                "checkpoint_type": "training" if path.kind == "weights" else "sampler",
                "time": iso(record["created"]), "tinker_path": str(path), "size_bytes": disk_bytes(directory),
                "public": False, "user_metadata": record.get("user_metadata") or None,
                "expires_at": None if expires is None else iso(expires)}

    def sampler_saves(self) -> Iterator[tuple[str, str, Path, dict[str, Any]]]:
        """Every sampler save on disk: (tenant, model id, version directory, record)."""
        for record_file in self.sampler_dir.glob(f"*/*/save-*/version_*/{RECORD}"):
            record = read_json(record_file)
            if record is not None:
                tenant, model_id = record_file.relative_to(self.sampler_dir).parts[:2]
                yield tenant, model_id, record_file.parent, record

    def set_ttl(self, tenant: str, path: TinkerPath, ttl: int | None) -> None:
        directory = self.save_dir(tenant, path) if path.kind == "weights" else self.sampler_save(tenant, path)[0]
        record = read_json(directory / RECORD)
        if record is None:
            raise NotFound(f"no checkpoint {str(path)!r} here")
        record["expires"] = None if ttl is None else time.time() + ttl
        write_json(directory / RECORD, record)

    def delete_training(self, tenant: str, path: TinkerPath) -> None:
        self.training_record(tenant, path)
        shutil.rmtree(self.save_dir(tenant, path))
        log.info("checkpoint deleted", extra={"tenant": tenant, "path": str(path)})
        self.measure(tenant)

    def expired(self) -> Iterator[tuple[str, Path, dict[str, Any]]]:
        """Every save whose time to live is over: (tenant, directory, record)."""
        now = time.time()
        for root, pattern in ((self.checkpoint_dir, f"*/*/*/{RECORD}"), (self.sampler_dir, f"*/*/*/*/{RECORD}")):
            for record_file in root.glob(pattern):
                record = read_json(record_file)
                if record is not None and record.get("expires") is not None and record["expires"] < now:
                    yield record_file.relative_to(root).parts[0], record_file.parent, record

    def remove_expired_training(self) -> None:
        """Removes the named training saves whose time to live is over (the sampler's go through the sampler)."""
        for tenant, directory, _ in list(self.expired()):
            if directory.is_relative_to(self.checkpoint_dir):
                shutil.rmtree(directory, ignore_errors=True)
                log.info("checkpoint expired and removed", extra={"tenant": tenant, "path": str(directory)})
                self.measure(tenant)

    def measure(self, tenant: str) -> int:
        """The tenant's bytes on disk, set as its metric."""
        used = disk_bytes(self.checkpoint_dir / tenant, self.sampler_dir / tenant)
        metrics.TENANT_DISK.labels(tenant).set(used)
        return used

    def measure_all(self) -> None:
        for root in (self.checkpoint_dir, self.sampler_dir):
            for tenant_dir in root.glob("*"):
                if tenant_dir.is_dir():
                    self.measure(tenant_dir.name)

    def resolve(self, tenant: str, raw: object, what: str, kinds: tuple[str, ...] = ("weights", "sampler_weights"),
                ) -> TinkerPath:
        """`raw` parsed strictly, of a run of the caller's tenant (404 otherwise)."""
        path = parse_path(raw, what, kinds)
        self.read_run(tenant, path.model_id)
        return path
