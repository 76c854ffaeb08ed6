"""On-policy distillation on real services: the student's replica samples, a teacher replica (a
standalone rollout service) scores the sampled tokens over its Score RPC, and the trainer trains on the
per-token advantages (algorithm.teacher). A teacher that goes away fails its groups (counted, never
trained without it) and stops the run with a clear error after the configured count.

A synchronizer, a trainer, the student's replica and the teacher's on the tiny model (the teacher is
the same weights: the reverse KL starts near 0 and grows as the student moves)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.integration.service_processes import Cluster, jsonl, tiny_run, wait_for

pytestmark = pytest.mark.slow

#: More than the run makes: the teacher is stopped after SCORED_STEPS, and the run stops for it.
STEPS = 40
SCORED_STEPS = 3


@pytest.mark.timeout(600)
def test_a_student_trains_on_a_teacher_replicas_scores_and_a_lost_teacher_stops_the_run(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    run_dir = tmp_path / "run"

    def steps() -> list[dict]:
        return [m for m in jsonl(run_dir / "metrics.jsonl") if "teacher/scored_total" in m]

    try:
        model, sync, trainer = cluster.tiny_fleet("student")
        teacher = cluster.teacher("teacher", model)  # the student's starting weights
        teacher.wait_ready(300)
        run = tiny_run("distill", STEPS, sync, trainer.grpc_address, mode="sync")
        run["algorithm"] = {**run["algorithm"], "teacher": {
            "addresses": [teacher.grpc_address], "timeout_seconds": 20.0, "max_attempts": 2,
            "retry_backoff_seconds": 0.2, "max_consecutive_failures": 3}}
        controller = cluster.controller(run, run_dir)
        wait_for(lambda: len(steps()) >= SCORED_STEPS, 300, f"{SCORED_STEPS} distilled steps", controller)
        # The teacher goes away: its groups fail, are counted, and the run stops with the reason.
        teacher.stop(grace=5)
        code = controller.wait(300)
        output = cluster.controller_output()
    finally:
        cluster.stop()
    assert code != 0, output
    assert "teacher critical" in output and "3 groups in a row" in output, output
    scored = steps()
    assert SCORED_STEPS <= len(scored) < STEPS
    first, last = scored[0], scored[-1]
    # Every trained group was scored by the teacher (4 a step) before the teacher went away.
    assert first["teacher/scored_total"] >= 4 and first["teacher/failed_total"] == 0
    assert last["teacher/scored_total"] >= 4 * len(scored)
    kls = [m["teacher/reverse_kl"] for m in scored if "teacher/reverse_kl" in m]
    assert kls and all(math.isfinite(k) for k in kls)
    assert abs(kls[0]) < 1e-3, f"the teacher is the student's starting weights: {kls}"
    trained = jsonl(run_dir / "trained_tasks.jsonl")
    assert len(trained) == len(scored), "a step trained without the teacher's scores"
