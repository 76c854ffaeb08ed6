"""The pipeline's hooks: where a launcher (or a test) extends its verbs.

after_resume runs once the trainer holds the checkpoint, after_start at the
end of start(), on_record with each trained step's metrics before they are
written; the launcher's resume count is an after_start hook.
"""

from __future__ import annotations

from pathlib import Path

from services.controller.launcher.local_run import _count_resumed_steps
from services.controller.loop import run
from services.controller.testing.simulated import run_virtual
from tests.unit.controller.controller_helpers import config, items, simulated_pipeline


def _run_config(max_steps: int, resume: str):
    return config(
        run={"max_steps": max_steps}, data={"train": {"items": items(48)}, "drop_last": False},
        checkpoint={"interval": 2, "at_end": True}, resume={"from": resume},
    )


def test_hooks_are_called_in_the_order_of_a_run(tmp_path: Path) -> None:
    first, trainer, _ = simulated_pipeline(_run_config(3, "none"), seed=3)
    first.run_dir = tmp_path
    resumes: list[int] = []

    async def resumed(p) -> None:
        resumes.append(p.train_worker.step)

    first.hooks.after_resume.append(resumed)
    run_virtual(run(first))
    assert resumes == [] and first.state.resumed_at_step == 0  # resume.from none: no resume, no hook

    second, _, _ = simulated_pipeline(_run_config(5, "latest"), seed=3, trainer=trainer)
    second.run_dir = tmp_path
    seen: list[tuple] = []

    async def after_resume(p) -> None:
        seen.append(("after_resume", p.train_worker.step, p.state.started))

    async def after_start(p) -> None:
        seen.append(("after_start", p.train_worker.step, p.state.started))

    def on_record(batch, result, metrics) -> None:
        written = second.memory.latest().get("step")
        seen.append(("on_record", result.step, metrics["step"], written))

    second.hooks.after_resume.append(after_resume)
    second.hooks.after_start += [after_start, _count_resumed_steps]
    second.hooks.on_record.append(on_record)
    summary = run_virtual(run(second))

    assert seen[:2] == [("after_resume", 3, False), ("after_start", 3, False)]
    # Each trained step once, with its metrics, before they reach the sinks (the previous step's are the latest).
    assert seen[2:] == [("on_record", 4, 4.0, None), ("on_record", 5, 5.0, 4.0)]
    # The launcher's count: run.max_steps counts the trainer's steps, resumed ones included.
    assert second.state.started and second.state.resumed_at_step == 3
    assert summary.steps == 5 and summary.stop_reason == "reached run.max_steps = 5"
