"""Bench records: a bench's closing figures, kept with the commit, CPU and date they were measured at.

Every script under bench/ ends with `record(bench, figures, args=args, smoke=...)`: it prints the
figures as one JSON line (what the bench tests and a reader's eye take) and, unless the run is a
smoke run, appends a record to `bench/results/<bench>.jsonl`. `docs/performance.md` and the
README's quickstart table are generated from those files (`scripts/performance_table.py`), and a
test fails when a figure they publish has no record. `make quickstart`'s runs are recorded from
their run directory (`scripts/record_quickstart.py`).

A record, one JSON object a line:
    bench       the bench's name (its file under bench/ without .py; "quickstart")
    commit      `git rev-parse HEAD`, with "-dirty" when tracked files differ from it
                (bench/results itself aside)
    date        when it was recorded (UTC, ISO 8601; a day for imported records)
    cpu_model, cpu_isa, cpu_flags, cpu_cores
                the machine (flywheel/testing/machine.py): cpu_isa is the best of
                amx | avx512_bf16 | avx512 | avx2 | other, cpu_flags those of
                machine.RECORDED_FLAGS the CPU has
    args        the bench's arguments
    smoke       always false in bench/results
    figures     the closing JSON line, as printed
    source      only on figures converted from the docs: where they were stated
    note        optional: what a reader needs to read the figures right

Smoke runs (CI) keep nothing in the repository: they write a record only where
FLYWHEEL_BENCH_RESULTS names a directory (a test's temporary one). That variable also sends
a real run's record elsewhere than bench/results.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flywheel.testing.machine import describe

ROOT = Path(__file__).resolve().parents[2]
#: Where records are kept, one file per bench.
RESULTS = ROOT / "bench" / "results"
#: A directory that takes the records instead of RESULTS (smoke runs' only destination).
ENV_DIR = "FLYWHEEL_BENCH_RESULTS"


def commit(root: Path = ROOT) -> str:
    """HEAD's hash, "-dirty" appended when a tracked file differs from it (records aside); "unknown"
    outside a git checkout."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else ""

    head = git("rev-parse", "HEAD")
    if not head:
        return "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    return head + ("-dirty" if changed else "")


def machine() -> dict[str, Any]:
    """The CPU fields of a record."""
    return dict(describe())


def _arguments(args: argparse.Namespace | dict[str, Any] | None) -> dict[str, Any]:
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    return json.loads(json.dumps(values, default=str))  # paths and the like as text


def make_record(
    bench: str, figures: dict[str, Any], *, args: argparse.Namespace | dict[str, Any] | None = None,
    smoke: bool = False, note: str | None = None,
) -> dict[str, Any]:
    """A record of `figures` measured here and now."""
    rec: dict[str, Any] = {
        "bench": bench,
        "commit": commit(),
        "date": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        **machine(),
        "args": _arguments(args),
        "smoke": smoke,
        "figures": json.loads(json.dumps(figures, default=str)),
    }
    if note:
        rec["note"] = note
    return rec


def destination(smoke: bool) -> Path | None:
    """The directory a record goes to: FLYWHEEL_BENCH_RESULTS when set, else bench/results for a
    real run and nowhere for a smoke run."""
    chosen = os.environ.get(ENV_DIR)
    if chosen:
        return Path(chosen)
    return None if smoke else RESULTS


def append(rec: dict[str, Any], directory: Path) -> Path:
    """Adds `rec` to <directory>/<bench>.jsonl (one line, one write)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{rec['bench']}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    return path


def keep(rec: dict[str, Any]) -> Path:
    """Keeps the record of a run measured outside a bench (a `make quickstart` run, a suite run) where a
    real run's record goes, and says where on stderr."""
    path = append(rec, destination(smoke=False) or RESULTS)
    print(f"record: {path}", file=sys.stderr, flush=True)
    return path


def record(
    bench: str, figures: dict[str, Any], *, args: argparse.Namespace | dict[str, Any] | None = None,
    smoke: bool = False, note: str | None = None,
) -> dict[str, Any]:
    """A bench's last words: prints `figures` as its one closing JSON line and keeps the record
    (smoke runs only where FLYWHEEL_BENCH_RESULTS says). Returns the record."""
    print(json.dumps(figures, default=str), flush=True)
    rec = make_record(bench, figures, args=args, smoke=smoke, note=note)
    directory = destination(smoke)
    if directory is not None:
        try:
            path = append(rec, directory)
        except OSError as exc:  # a read-only checkout: the printed line is still the result
            print(f"(record not kept: {exc})", file=sys.stderr)
        else:
            print(f"record: {path}", file=sys.stderr, flush=True)
    return rec


def read(directory: Path = RESULTS) -> dict[str, list[dict[str, Any]]]:
    """Every record under `directory`, by bench, in file order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[path.stem] = rows
    return out
