"""Persistence of component states, committed version metadata and the
policy in a small SQLite file, so a restarted synchronizer resumes the run.

Writes are tiny and rare (registrations, state changes, commits), so they run
synchronously on the event loop; WAL mode with synchronous=NORMAL keeps each
well under a millisecond and survives a process crash (only an OS crash may
lose the last transaction). Weight bytes are never stored here.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flywheel.common.v1 import common_pb2
from flywheel.probe import ProbeBatch
from flywheel.synchronizer.types import Component, Identity, Method, Policy, Role, RolloutWait, State, Style
from services.synchronizer.versions import VersionRecord

_SCHEMA = """
CREATE TABLE IF NOT EXISTS components (
  id TEXT PRIMARY KEY, role INTEGER NOT NULL, address TEXT NOT NULL, capabilities TEXT NOT NULL,
  labels TEXT NOT NULL, state INTEGER NOT NULL, step INTEGER NOT NULL, weight_version INTEGER NOT NULL,
  last_heartbeat_ms INTEGER NOT NULL, last_sync_step INTEGER NOT NULL, awaited_version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
  version INTEGER PRIMARY KEY, method INTEGER NOT NULL, nbytes INTEGER NOT NULL, path TEXT NOT NULL,
  committed_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
#: Columns added after the first schema, with their values for rows written before them.
_ADDED_COLUMNS = {
    "components": {"weight_identity": "BLOB NOT NULL DEFAULT x''", "quarantine_reason": "TEXT"},
    # tensors: JSON name -> hex digest; probe: a serialized common.v1.ProbeBatch (float32 exactly as sent).
    "versions": {"identity": "BLOB NOT NULL DEFAULT x''", "epoch": "INTEGER NOT NULL DEFAULT 0",
                 "tensors": "TEXT NOT NULL DEFAULT '{}'", "probe": "BLOB NOT NULL DEFAULT x''"},
}


class Store:
    """SQLite-backed store; `Store(None)` keeps nothing (state is lost on restart)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._add_columns()

    def _add_columns(self) -> None:
        """A store written by an older synchronizer gains the newer columns (rows keep their defaults)."""
        assert self._db is not None
        for table, columns in _ADDED_COLUMNS.items():
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for name, decl in columns.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    @property
    def enabled(self) -> bool:
        return self._db is not None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _run(self, sql: str, params: Sequence[object] = ()) -> list[tuple]:
        """The rows of `sql` (none for a write); nothing is run when the store keeps nothing."""
        if self._db is None:
            return []
        return self._db.execute(sql, params).fetchall()

    def _put_setting(self, key: str, value: object) -> None:
        self._run("INSERT OR REPLACE INTO settings VALUES (?, ?)", (key, json.dumps(value)))

    def _setting(self, key: str) -> Any:
        """The JSON value saved under `key` in the settings table; None if there is none."""
        rows = self._run("SELECT value FROM settings WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else None

    # -- writes --------------------------------------------------------------

    def save_component(self, c: Component) -> None:
        if self._db is None:
            return
        ident = c.identity
        self._db.execute(
            "INSERT OR REPLACE INTO components (id, role, address, capabilities, labels, state, step, weight_version,"
            " last_heartbeat_ms, last_sync_step, awaited_version, weight_identity, quarantine_reason)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                ident.id, int(ident.role), ident.address, json.dumps(sorted(int(m) for m in ident.capabilities)),
                json.dumps(ident.labels), int(c.state), c.step, c.weight_version, c.last_heartbeat_ms,
                c.last_sync_step, c.awaited_version, c.weight_identity,
                c.quarantine_reason if c.quarantined else None,
            ),
        )

    def save_version(self, r: VersionRecord) -> None:
        if self._db is None:
            return
        self._db.execute(
            "INSERT OR REPLACE INTO versions (version, method, nbytes, path, committed_unix_ms, identity, epoch,"
            " tensors, probe) VALUES (?,?,?,?,?,?,?,?,?)",
            (r.version, int(r.method), r.nbytes, r.path, r.committed_unix_ms, r.identity, r.epoch,
             json.dumps({name: digest.hex() for name, digest in r.tensors.items()}),
             r.probe.to_pb().SerializeToString() if r.probe is not None else b""),
        )

    def save_policy(self, policy: Policy) -> None:
        self._put_setting("policy", {**asdict(policy), "style": policy.style.name, "method": policy.method.name,
                                     "rollout_wait": policy.rollout_wait.name})  # pause_mode is a name already

    # -- reads ---------------------------------------------------------------

    def load_components(self) -> list[Component]:
        rows = self._run(
            "SELECT id, role, address, capabilities, labels, state, step, weight_version, last_heartbeat_ms,"
            " last_sync_step, awaited_version, weight_identity, quarantine_reason FROM components ORDER BY id"
        )
        out = []
        for cid, role, address, caps, labels, state, step, version, hb, last_sync, awaited, held, why in rows:
            identity = Identity(
                role=Role(role), id=cid, address=address,
                capabilities=frozenset(Method(m) for m in json.loads(caps)), labels=json.loads(labels),
            )
            out.append(Component(
                identity=identity, state=State(state), step=step, weight_version=version,
                last_heartbeat_ms=hb, last_sync_step=last_sync, awaited_version=awaited,
                weight_identity=bytes(held), quarantined=why is not None, quarantine_reason=why or "",
            ))
        return out

    def load_versions(self) -> list[VersionRecord]:
        rows = self._run(
            "SELECT version, method, nbytes, path, committed_unix_ms, identity, epoch, tensors, probe FROM versions"
            " ORDER BY version"
        )
        return [
            VersionRecord(v, Method(m), n, p, t, bytes(i), e,
                          tensors={name: bytes.fromhex(d) for name, d in json.loads(digests).items()},
                          probe=ProbeBatch.from_pb(common_pb2.ProbeBatch.FromString(bytes(probe))))
            for v, m, n, p, t, i, e, digests, probe in rows
        ]

    def load_policy(self) -> Policy | None:
        data = self._setting("policy")
        if data is None:
            return None
        wait = RolloutWait[data.get("rollout_wait", "NONE")]  # absent in stores written before it existed
        return Policy(**{**data, "style": Style[data["style"]], "method": Method[data["method"]], "rollout_wait": wait})

    def drop_versions_above(self, version: int) -> None:
        self._run("DELETE FROM versions WHERE version > ?", (version,))

    def save_lineage(self, epoch: int, rewound_to: int, dropped: Iterable[int] = ()) -> None:
        self._put_setting("lineage", {"epoch": epoch, "rewound_to": rewound_to, "dropped": sorted(dropped)})

    def load_lineage(self) -> tuple[int, int, set[int]]:
        """(epoch, rewound_to, the versions rewinds dropped) as of the last rewind; (0, 0, {}) before any."""
        data = self._setting("lineage")
        if data is None:
            return 0, 0, set()
        # "dropped" is absent in stores written before it existed.
        return int(data["epoch"]), int(data["rewound_to"]), {int(v) for v in data.get("dropped", ())}

    def trim_versions(self, keep_from: int) -> None:
        self._run("DELETE FROM versions WHERE version < ?", (keep_from,))
