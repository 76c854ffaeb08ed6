"""The ledger of trained tasks: `<run_dir>/trained_tasks.jsonl`, one line per trained step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO


def keep_ledger(run_dir: Path, session: str, pipeline: Any) -> TextIO:
    """Appends each trained step's task ids and sample versions to `trained_tasks.jsonl`, marked
    with `session` (unique to each session of a launch, a rewind's included); returns the open file.

    Metrics carry counts, not ids; this ledger is what lets a user (and the
    resume test) check that every example was trained exactly once across
    kills and resumes: per step, the last session's line counts.
    """
    ledger = (run_dir / "trained_tasks.jsonl").open("a")

    def write_row(batch: Any, result: Any, metrics: dict[str, float]) -> None:
        tasks = sorted({t.task.id for t in batch.trajectories})
        # Which weights produced each sample, beside the weights trained on:
        # the mode's staleness promise, checkable after the fact.
        versions = [[t.version_start, t.version_end] for t in batch.trajectories]
        row = {"step": result.step, "session": session, "tasks": tasks,
               "trained_version": batch.target_version, "sample_versions": versions,
               "sample_engines": [t.engine for t in batch.trajectories],
               # Each model call's versions, for multi-turn episodes (empty lists otherwise).
               "sample_turn_versions": [[list(v) for v in t.turn_versions] for t in batch.trajectories]}
        ledger.write(json.dumps(row) + "\n")
        ledger.flush()

    pipeline.hooks.on_record.append(write_row)  # called once per trained step, before its metrics are written
    return ledger
