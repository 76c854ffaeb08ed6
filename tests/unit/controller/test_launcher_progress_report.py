"""The progress line and the end-of-run report."""

from __future__ import annotations

import io
import json

from services.controller.launcher.progress import Progress, progress_line
from services.controller.launcher.report import read_history, write_report


def test_progress_line_shows_step_reward_accuracy_staleness_throughput():
    metrics = {"rollout/reward_mean": 0.5, "rollout/accuracy_mean": 0.25, "staleness/mean": 0.75,
               "throughput/samples_per_second": 3.21}
    line = progress_line(5, 10, metrics, 0.4, 65.0, steps_this_session=5)
    for part in ("step 5/10", "[#####-----]", "reward 0.50", "acc 0.25", "val_acc 0.40", "stale 0.8",
                 "3.2 samples/s", "01:05", "eta 01:05"):
        assert part in line, (part, line)
    assert "reward -" in progress_line(0, None, {}, None, 0.0)


def test_progress_prints_one_line_per_step_when_not_a_terminal():
    out = io.StringIO()
    p = Progress(4, out)
    for step in (0, 0, 1, 1, 2):
        p.update(step, {}, None)
    assert out.getvalue().count("\n") == 3


def _write_metrics(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "cut sho')


def test_report_uses_the_last_row_of_each_step_and_validation_before_after(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl", [
        {"step": 0, "val/accuracy": 0.1},
        {"step": 1, "rollout/reward_mean": 0.2},
        {"step": 2, "rollout/reward_mean": 0.9},  # a killed session's step 2 ...
        {"step": 2, "rollout/reward_mean": 0.3},  # ... redone after resume
        {"step": 2, "val/accuracy": 0.5},
    ])
    steps, _ = read_history(tmp_path / "metrics.jsonl")
    assert [r["rollout/reward_mean"] for r in steps] == [0.2, 0.3]
    report = write_report(tmp_path, name="t", summary={"stop_reason": "done"}, checkpoint="/c/global_step_2",
                          wall_seconds=1.0)
    assert report["validation"]["before"] == {"step": 0, "value": 0.1}
    assert report["validation"]["after"] == {"step": 2, "value": 0.5}
    assert report["model"] == "/c/global_step_2/model" and report["stop_reason"] == "done"
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    assert (tmp_path / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
