"""The end of a run: `summary.json` and `progress.png` in the run directory.

Both are built from `metrics.jsonl` (the whole run's history, resumed
sessions included), so a resumed run's report covers every step, not only
the last session's. The plot shows the training reward per step and the
validation accuracy at each validation (matplotlib with the Agg backend, no
display needed); without matplotlib the plot is skipped with a note.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_history(metrics_path: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """(training step rows, validation rows) of a metrics.jsonl; the last row of a
    step wins (a resumed run may rewrite steps after its checkpoint)."""
    steps: dict[int, dict[str, float]] = {}
    validations: dict[int, dict[str, float]] = {}
    if not metrics_path.exists():
        return [], []
    for line in metrics_path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        step = int(row.get("step", 0))
        if any(k.startswith("val/") for k in row):
            validations[step] = row
        elif "rollout/reward_mean" in row:
            steps[step] = row
    return [steps[s] for s in sorted(steps)], [validations[s] for s in sorted(validations)]


def plot(steps: list[dict[str, float]], validations: list[dict[str, float]], out: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if steps:
        ax.plot([r["step"] for r in steps], [r["rollout/reward_mean"] for r in steps], label="train reward (mean)",
                color="tab:blue", alpha=0.8)
    key = "val/accuracy" if any("val/accuracy" in r for r in validations) else "val/reward"
    vals = [r for r in validations if key in r]
    if vals:
        ax.plot([r["step"] for r in vals], [r[key] for r in vals], "o-", label=f"validation {key.split('/')[1]}",
                color="tab:orange")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_report(
    run_dir: Path, *, name: str, summary: dict[str, Any], checkpoint: str, wall_seconds: float,
    job_seconds: float | None = None,
) -> dict:
    """Writes summary.json (and progress.png); returns the summary dict. `job_seconds`: from the
    services being ready to now (the job's own time, without setup and model loading)."""
    steps, validations = read_history(run_dir / "metrics.jsonl")
    val_key = "val/accuracy" if any("val/accuracy" in r for r in validations) else "val/reward"
    first_val = next((r for r in validations if val_key in r), None)
    last_val = next((r for r in reversed(validations) if val_key in r), None)
    png = plot(steps, validations, run_dir / "progress.png", f"{name}: reward and validation accuracy")
    report = {
        "name": name,
        "run_dir": str(run_dir),
        "steps": len(steps),
        "last_step": int(steps[-1]["step"]) if steps else 0,
        "wall_seconds_this_session": round(wall_seconds, 1),
        "job_seconds_this_session": None if job_seconds is None else round(job_seconds, 1),
        "validation": {
            "metric": val_key,
            "before": None if first_val is None else {"step": int(first_val["step"]), "value": first_val[val_key]},
            "after": None if last_val is None else {"step": int(last_val["step"]), "value": last_val[val_key]},
            "history": [{"step": int(r["step"]), "value": r[val_key]} for r in validations if val_key in r],
        },
        "final_metrics": steps[-1] if steps else {},
        "checkpoint": checkpoint,
        "model": str(Path(checkpoint) / "model") if checkpoint else "",
        "plot": str(png) if png else "",
        **summary,
    }
    (run_dir / "summary.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report
