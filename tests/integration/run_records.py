"""A run directory's records, read back by the integration tests that watch a run (the files are the
controller's: services/controller/telemetry/)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.integration.service_processes import jsonl


@dataclass(frozen=True)
class RunRecords:
    run_dir: Path

    def ledger(self) -> list[dict]:
        """A row per trained step, with its tasks and each sample's versions and engine, as written so far."""
        return jsonl(self.run_dir / "trained_tasks.jsonl")

    def events(self) -> list[dict]:
        """The synchronizer's events as the controller watched them, in order, as written so far."""
        return jsonl(self.run_dir / "synchronizer_events.jsonl")


def samples_of(rows: list[dict], replica: str) -> list[tuple[int, int, int]]:
    """(step, version_start, version_end) of every trained sample in `rows` (the ledger) the replica generated."""
    return [(row["step"], start, end) for row in rows
            for (start, end), engine in zip(row["sample_versions"], row["sample_engines"]) if engine == replica]


def updates_of(events: list[dict], replica: str) -> list[dict]:
    """The weight updates the replica reported, in order."""
    return [e["update"] for e in events if e["kind"] == "UPDATE_REPORTED" and e["update"]["id"] == replica]
