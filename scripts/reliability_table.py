"""Writes docs/reliability.md from the chaos trials' record (FLYWHEEL_CHAOS_RECORD, one JSON line a
trial, written by tests/integration/test_quickstart_tiny.py, passed or failed):

    FLYWHEEL_CHAOS_TRIALS=20 FLYWHEEL_CHAOS_RECORD=runs/chaos.jsonl \\
        .venv/bin/python -m pytest tests/integration/test_quickstart_tiny.py -k chaos -s
    .venv/bin/python scripts/reliability_table.py runs/chaos.jsonl --commit <sha> --cpu "<lscpu model>"

Several records (sessions) may be given: their trials add up.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("records", nargs="+", type=Path)
    parser.add_argument("--commit", required=True, help="the commit the trials ran on")
    parser.add_argument("--cpu", required=True, help="the machine they ran on (lscpu's model name, cores)")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.records for line in path.read_text().splitlines() if line.strip()]
    healed = sum(r["healed"] for r in rows)
    by_victim = Counter(r["victim"] for r in rows)
    lines = [
        "# Reliability: services killed mid-run",
        "",
        "The chaos test (`tests/integration/test_quickstart_tiny.py`, `-k chaos`) runs the tiny quickstart",
        "(10 steps, 40 questions) and SIGKILLs one service at a random step; a trial passes when the one",
        "command heals it by itself (a replica restarted; the trainer or the synchronizer by rewinding",
        "every service to the last checkpoint), exits 0 at step 10, every question is trained exactly",
        "once in the final model's lineage, and no process is left. CI runs 3 trials (one per service);",
        "this table is the long run, rendered by `scripts/reliability_table.py` from the trials' record.",
        "",
        f"Commit {args.commit}, {args.cpu}: **{healed} of {len(rows)} trials healed** "
        f"({', '.join(f'{n} x {v}' for v, n in sorted(by_victim.items()))}).",
        "",
        "| seed | trial | killed | at step | exit | healed | seconds | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['trial']} | {r['victim']} | {r['killed_at'] if r['killed_at'] is not None else '-'} "
                     f"| {r['exit'] if r['exit'] is not None else '-'} | {'yes' if r['healed'] else '**no**'} "
                     f"| {r['seconds']} | {r['error'] or ''} |")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}: {healed}/{len(rows)} healed")


if __name__ == "__main__":
    main()
