"""The learning benchmark: how fast the quickstart job gets better, and where its time goes.

Run manual (the job part is the quickstart itself: ~15 min on 2 CPU cores):
    python bench/learning.py                         # all three parts
    python bench/learning.py --smoke                 # the trainer part on a tiny model, one step (CI)
    python bench/learning.py --parts trainer,validation
    python bench/learning.py --seed 1 --target 0.35

Three parts, each printing its figures; one JSON line at the end, with the CPU's
model and ISA (flywheel/testing/machine.py) beside them.
  trainer     Our trainer's step (TrainingEngine.train_step, in this process:
              GRPO loss, log-probs at the completion's positions, AdamW) vs
              the plain-torch floor: the same model and batch (shaped like a
              quickstart batch: train_batch_size samples, prompt + max_tokens
              tokens, the samples of a group sharing their prompt) through a
              transformers forward with labels (cross-entropy) + backward +
              AdamW step, with the same autocast and threads. The floor runs
              every row whole; ours computes a shared prompt once per group
              (docs/architecture.md, "A training step on a CPU"), so it may
              come out below 1. Steps alternate ours/floor after a warm-up; medians.
              -> trainer_step_vs_torch_floor (seconds over seconds; goal <= 1.1).
  validation  One rollout service (the quickstart's engine settings, base
              model). Ours: the controller's Validator with the quickstart's
              math worker over the validation questions (every question in
              flight at once, as a run does). Baseline: the same prompts in one
              Generate request, the engine given all of them at once.
              Alternating, medians. -> validation_vs_all_at_once (seconds over
              seconds; 1.0 means validation costs nothing beyond the engine).
  job         `python -m services.controller run examples/quickstart.yaml`
              in a fresh run directory: seconds from the services being ready
              to the first validation at or above --target (default: the
              first validation + 0.15), the final validation accuracy, and the
              mean seconds per step split into generation and training (busy
              seconds; they overlap in batch-async) and weight sync (a
              version staged at the synchronizer to a replica serving it).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.testing.machine import cpu  # noqa: E402
from flywheel.testing.records import record  # noqa: E402
from flywheel.launcher.processes import start_service  # noqa: E402
from flywheel.rollout.client import RolloutClient  # noqa: E402
from services.controller.launcher.prepare import prepare_data, prepare_model  # noqa: E402
from services.controller.launcher.spec import split_run_file  # noqa: E402

QUICKSTART = ROOT / "examples" / "quickstart.yaml"
PROMPT_TOKENS = 40  # a quickstart prompt with its chat template and system prompt (SmolLM2: 40)


def quickstart() -> tuple[object, dict]:
    return split_run_file(yaml.safe_load(QUICKSTART.read_text()), f"file {QUICKSTART}")


# ------------------------------------------------------------------ trainer


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def bench_trainer(model_dir: Path, run: dict, spec: object, steps: int, work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from services.trainer.config import TrainerConfig
    from services.trainer.policy import autocast_dtype
    from services.trainer.loss_request import LossRequest
    from services.trainer.training import TrainingEngine

    trainer_spec = dict(getattr(spec, "trainer", {}) or {})
    model_spec = dict(trainer_spec.get("model") or {})
    autocast_name = model_spec.get("autocast", "none")
    autocast = autocast_dtype(autocast_name, "cpu")
    threads = model_spec.get("cpu_threads") or os.cpu_count() or 1
    torch.set_num_threads(threads)
    batch_size = int(run["algorithm"]["train_batch_size"])
    completion = int(run["worker"]["sampling"]["max_tokens"])
    seq_len = PROMPT_TOKENS + completion
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(49_000, _vocab_size(model_dir)), (batch_size, seq_len), generator=g)
    group = int(run["worker"]["group_size"])
    for first in range(0, batch_size, group):  # a group's samples answer the same prompt
        ids[first:first + group, :PROMPT_TOKENS] = ids[first, :PROMPT_TOKENS]
    attention = torch.ones(batch_size, seq_len, dtype=torch.int64)
    loss_mask = torch.zeros(batch_size, seq_len)
    loss_mask[:, PROMPT_TOKENS:] = 1.0
    batch = {
        "input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
        "advantages": torch.linspace(-1.0, 1.0, batch_size),
        "behaviour_logprobs": -torch.rand(batch_size, seq_len, generator=g) * 3 * loss_mask,
        "weight_versions": torch.zeros(batch_size, dtype=torch.int64),
        # The sampling contract, as the quickstart's batches carry it (its sampling temperature).
        "sampling_temperature": torch.full((batch_size,), float(run["worker"]["sampling"].get("temperature", 1.0))),
    }
    lr = 1e-7  # the weights barely move: every step sees the same model
    config = TrainerConfig.model_validate({
        "model": {"path": str(model_dir), "dtype": "float32", "autocast": autocast_name, "cpu_threads": threads},
        "optimizer": {"lr": lr}, "checkpoint": {"dir": str(work / "checkpoints")},
    })
    ours = TrainingEngine(config)
    ours.load()
    floor_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    floor_model.train()
    floor_opt = torch.optim.AdamW(floor_model.parameters(), lr=lr)

    def our_step() -> float:
        t = time.perf_counter()
        ours.train_step(batch, LossRequest(kind="grpo"))
        return time.perf_counter() - t

    def floor_step() -> float:
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = floor_model(input_ids=ids, attention_mask=attention, labels=ids)
        out.loss.backward()
        floor_opt.step()
        floor_opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    our_step(), floor_step()  # warm-up: allocator, optimizer state
    mine, floor = [], []
    for _ in range(steps):
        gc.collect()
        mine.append(our_step())
        gc.collect()
        floor.append(floor_step())
    result = {
        "trainer_batch": f"{batch_size}x{seq_len} tokens ({completion} completion), autocast {autocast_name} ({autocast}), {threads} threads",
        "trainer_step_seconds": round(statistics.median(mine), 3),
        "torch_floor_step_seconds": round(statistics.median(floor), 3),
    }
    result["trainer_step_vs_torch_floor"] = round(result["trainer_step_seconds"] / result["torch_floor_step_seconds"], 3)
    gc.collect()
    return result


# ------------------------------------------------------------------ validation


async def _validation_sides(address: str, run: dict, rows: list[dict], rounds: int) -> dict:
    from services.controller.adapters.rollout import GrpcRolloutEngine
    from services.controller.rollouts.balancer import EnginePool
    from services.controller.domain import SamplingSpec, Task
    from services.controller.telemetry.errors_report import ErrorReporter
    from services.controller.tasks.rewards import get_reward
    from services.controller.rollouts.validation import Validator
    from services.controller.workers.base import WorkerContext
    from services.controller.workers.math import SingleTurnMathWorker

    worker_cfg, val_cfg = run["worker"], run.get("validation") or {}
    max_tokens = int((val_cfg.get("sampling") or {}).get("max_tokens") or worker_cfg["sampling"]["max_tokens"])
    engine = GrpcRolloutEngine(address, name="bench")
    ctx = WorkerContext(engines=EnginePool([engine]), reward=get_reward("math"),
                        system_prompt=worker_cfg.get("system_prompt"), instruction=worker_cfg.get("instruction"))
    worker = SingleTurnMathWorker(ctx)

    class Loader:  # the validation set, in order, once per pass
        def __init__(self) -> None:
            self.i = 0

        def reset(self) -> None:
            self.i = 0

        def next(self) -> Task | None:
            if self.i >= len(rows):
                return None
            row = rows[self.i]
            self.i += 1
            return Task(id=f"val-{self.i}", index=self.i - 1, epoch=0, prompt=row["question"], answer=row["answer"])

    validator = Validator(worker, Loader(), ErrorReporter("continue", 100), interval=1,  # type: ignore[arg-type]
                          sampling=SamplingSpec(temperature=0.0, max_tokens=max_tokens))
    prompts = [worker.messages_for(Task(id=str(i), index=i, epoch=0, prompt=r["question"], answer=r["answer"])) for i, r in enumerate(rows)]
    client = RolloutClient(address, timeout=1200)
    ours, baseline, accuracy = [], [], 0.0
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            metrics = await validator.run(0)
            ours.append(time.perf_counter() - t)
            accuracy = metrics.get("val/accuracy", 0.0)
            t = time.perf_counter()
            await client.generate(prompts, temperature=0.0, max_tokens=max_tokens, n=1)
            baseline.append(time.perf_counter() - t)
    finally:
        await client.close()
        await engine.close()
    return {"validation_questions": len(rows), "validation_accuracy_base_model": round(accuracy, 4),
            "validation_seconds": round(statistics.median(ours), 2),
            "all_at_once_seconds": round(statistics.median(baseline), 2),
            "validation_vs_all_at_once": round(statistics.median(ours) / statistics.median(baseline), 3)}


def bench_validation(model_dir: Path, run: dict, spec: object, work: Path, rounds: int) -> dict:
    data = prepare_data(spec.dataset, dict(run.get("data") or {}), work / "data")  # type: ignore[attr-defined]
    rows = [json.loads(line) for line in Path(data["validation"]["path"]).read_text().splitlines()]
    rollout_spec = dict(getattr(spec, "rollout", {}) or {})
    engine = dict(rollout_spec.get("engine") or {})
    config = {"http_port": 0, "engine": {**engine, "model_path": str(model_dir),
                                          "args": {**(engine.get("args") or {}), "dtype": spec.model.dtype}}}  # type: ignore[attr-defined]
    config_path = work / "rollout.yaml"
    config_path.write_text(yaml.safe_dump(config))
    child = start_service("rollout", work, ["--config", str(config_path)], python=sys.executable)
    try:
        child.wait_ready(600)
        return asyncio.run(_validation_sides(child.grpc_address, run, rows, rounds))
    finally:
        child.stop()


# ------------------------------------------------------------------ job


def bench_job(work: Path, seed: int | None, target: float | None, max_steps: int | None) -> dict:
    import subprocess

    run_dir = work / "job"
    command = [sys.executable, "-m", "services.controller", "run", str(QUICKSTART), "--run-dir", str(run_dir),
               "--resume", "disable"]
    if seed is not None:
        command += ["--seed", str(seed)]
    if max_steps is not None:
        command += ["--max-steps", str(max_steps)]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"the quickstart job failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {"job_wall_seconds": round(wall, 1), **job_figures(run_dir, target)}


def job_figures(run_dir: Path, target: float | None) -> dict:
    """The figures of a finished quickstart run directory."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r for r in rows if "rollout/reward_mean" in r]
    validations = [r for r in rows if "val/accuracy" in r]
    # The launcher's summary is written at the job's end: the services were ready job_seconds before it.
    job_seconds = float(summary["job_seconds_this_session"])
    ready_ms = (run_dir / "summary.json").stat().st_mtime * 1000 - job_seconds * 1000
    before, final = validations[0]["val/accuracy"], validations[-1]["val/accuracy"]
    goal = target if target is not None else before + 0.15
    reached = next((v for v in validations if v["val/accuracy"] >= goal), None)

    def per_step(key: str) -> float:  # the metrics' busy seconds are totals since the run began
        return round(max(r.get(key, 0.0) for r in steps) / len(steps), 2)

    return {
        "job_steps": len(steps), "job_seconds_ready_to_summary": job_seconds,
        "val_accuracy_before": round(before, 4), "val_accuracy_final": round(final, 4),
        "val_accuracy_target": round(goal, 4),
        "seconds_to_target": round((reached["unix_ms"] - ready_ms) / 1000, 1) if reached else None,
        "validation_pass_seconds": round(statistics.fmean(v.get("val/seconds", 0.0) for v in validations), 1),
        "step_seconds": round(statistics.fmean(r["time/step_seconds"] for r in steps), 2),
        "step_generation_seconds": per_step("time/busy_seconds/rollout"),
        "step_training_seconds": per_step("time/busy_seconds/trainer"),
        "step_weight_sync_seconds": _sync_seconds(run_dir / "synchronizer_events.jsonl"),
    }


def _sync_seconds(events_path: Path) -> float | None:
    """Mean seconds from a version being staged at the synchronizer (the trainer's publish begins) to a
    rollout replica serving it, from the run's synchronizer_events.jsonl."""
    if not events_path.exists():
        return None
    staged: dict[int, float] = {}
    served: dict[int, float] = {}
    for line in events_path.read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "VERSION_STAGED":
            staged.setdefault(int(event["version"]), event["unix_ms"])
        elif event["kind"] == "STATE_CHANGED" and event.get("role") == "ROLLOUT":
            version = int(event.get("weight_version", 0))
            served.setdefault(version, event["unix_ms"])
    lags = [served[v] - t for v, t in staged.items() if v in served and served[v] >= t]
    return round(statistics.fmean(lags) / 1000, 2) if lags else None


# ------------------------------------------------------------------ main


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--parts", default="trainer,validation,job",
                        help="comma-separated: trainer, validation, job (default all three; smoke trainer)")
    parser.add_argument("--trainer-steps", type=int, default=4, help="timed steps per side (default 4; smoke 1)")
    parser.add_argument("--validation-rounds", type=int, default=2, help="timed passes per side")
    parser.add_argument("--seed", type=int, default=None, help="the job's --seed")
    parser.add_argument("--max-steps", type=int, default=None, help="the job's --max-steps")
    parser.add_argument("--target", type=float, default=None, help="validation accuracy to reach; default first + 0.15")
    args = parse_with_smoke(parser, "the trainer part only, a tiny model (batch 4, 8 completion tokens), one step (CI)",
                            parts="trainer", trainer_steps=1)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if args.smoke and "job" in parts:
        parser.error("--smoke sizes the trainer and validation parts (a tiny model): the job part is the "
                     "quickstart job itself, with no smoke size; run it without --smoke")
    spec, run = quickstart()
    figures: dict[str, object] = dict(cpu())
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        work = Path(tmp)
        if args.smoke:
            from flywheel.models.tiny import build_tiny_model

            run["algorithm"]["train_batch_size"], run["worker"]["sampling"]["max_tokens"] = 4, 8
            model_dir = build_tiny_model(work / "tiny")
        else:
            model_dir = prepare_model(spec.model)  # type: ignore[attr-defined]
        if "trainer" in parts:
            figures.update(bench_trainer(model_dir, run, spec, args.trainer_steps, work))
            print({k: v for k, v in figures.items() if "trainer" in k or "floor" in k}, flush=True)
        if "validation" in parts:
            figures.update(bench_validation(model_dir, run, spec, work, args.validation_rounds))
            print({k: v for k, v in figures.items() if "valid" in k or "all_at_once" in k}, flush=True)
        if "job" in parts:
            figures.update(bench_job(work, args.seed, args.target, args.max_steps))
    record("learning", figures, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
