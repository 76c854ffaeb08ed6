"""Records a `make quickstart` run (its summary.json) in bench/results/quickstart.jsonl.

    make quickstart                                      # or make quickstart SEED=1 (runs/quickstart-seed1)
    python scripts/record_quickstart.py runs/quickstart  # then: python scripts/performance_table.py
    python scripts/record_quickstart.py runs/quickstart-seed1 --run-minutes 31.3 --note "resumed once"
    python scripts/record_quickstart.py runs/fully-async --config fully-async.yaml   # the job in another mode

Run it on the machine that ran the job, at the same commit: the record takes this checkout's commit
and this CPU (flywheel/testing/records.py). The figures come from the run directory: the held-out
accuracy at every validation (summary.json), the run time of the last session (from the services
being ready to the summary; give --run-minutes for a run stopped and resumed, whose earlier
sessions summary.json does not count), the median step time and the mean staleness of the trained
samples (metrics.jsonl). A run of the quickstart's job in another mode names its run file (--config):
the record then holds the file's mode and staleness settings, and the README's quickstart table,
which shows the quickstart as it ships, leaves it out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import yaml
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.testing.records import keep, make_record  # noqa: E402


def figures(run_dir: Path, seed: int, run_minutes: float | None, setup_seconds: float | None) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    val = summary.get("validation") or {}
    history = {str(h["step"]): round(h["value"], 4) for h in val.get("history", [])}
    out: dict[str, Any] = {"seed": seed, "steps": summary.get("last_step"), "validation": history}
    if val.get("before"):
        out["val_before"] = round(val["before"]["value"], 4)
    if val.get("after"):
        out["val_after"], out["after_step"] = round(val["after"]["value"], 4), val["after"]["step"]
    if run_minutes is not None:
        out["run_minutes"] = run_minutes
    elif summary.get("job_seconds_this_session") is not None:
        out["run_minutes"] = round(summary["job_seconds_this_session"] / 60, 1)
    metrics = _metrics(run_dir)
    step_seconds = [row["time/step_seconds"] for row in metrics if "time/step_seconds" in row]
    if step_seconds:
        out["median_step_seconds"] = round(statistics.median(step_seconds), 1)
    staleness = [row["staleness/mean"] for row in metrics if "staleness/mean" in row]
    if staleness:
        out["mean_staleness"] = round(statistics.fmean(staleness), 2)
    if summary.get("restarts"):
        out["restarts"] = summary["restarts"]
    if setup_seconds is not None:
        out["setup_seconds"] = setup_seconds
    return out


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run directory (runs/quickstart, runs/quickstart-seed<n>)")
    parser.add_argument("--seed", type=int, help="the run's seed; default: from the directory's name, else 0")
    parser.add_argument("--run-minutes", type=float, help="the whole run's time, for a run stopped and resumed")
    parser.add_argument("--setup-seconds", type=float, help="how long `make setup` took in this checkout, if timed")
    parser.add_argument("--note", help="what a reader needs to read the figures right")
    parser.add_argument("--config", type=Path,
                        help="the run file, for a run of the quickstart's job in another mode: its mode and staleness "
                        "settings are recorded")
    args = parser.parse_args()
    if not (args.run_dir / "summary.json").is_file():
        parser.error(f"{args.run_dir}/summary.json not found: the run has not ended (or this is not a run directory)")
    seed = args.seed
    if seed is None:
        match = re.search(r"-seed(\d+)$", args.run_dir.resolve().name)
        seed = int(match.group(1)) if match else 0
    figs = figures(args.run_dir, seed, args.run_minutes, args.setup_seconds)
    recorded_args: dict[str, Any] = {"run_dir": str(args.run_dir), "seed": seed}
    if args.config is not None:
        run_file = yaml.safe_load(args.config.read_text())
        figs["mode"], figs["staleness"] = run_file.get("mode", "sync"), run_file.get("staleness") or {}
        recorded_args["config"] = str(args.config)
    rec = make_record("quickstart", figs, args=recorded_args, note=args.note)
    print(json.dumps(figs))
    keep(rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
