"""The Tinker cookbook's arithmetic RL recipe, unmodified, through the Tinker gateway, and the
same batch on our own controller: the recipe's reward step by step, and seconds per step of both.

Run manual:
    python bench/tinker_recipe.py --renderer qwen3_instruct --max-tokens 8 --temperature 0.7
                                                  # SmolLM2-135M-Instruct, 20 recipe steps (~15 min)
    python bench/tinker_recipe.py --smoke         # the tiny model, 2 steps each: checks it runs (CI)

SmolLM2 speaks ChatML, which the cookbook's qwen3_instruct renderer writes (its stop token is
SmolLM2's <|im_end|>); with role_colon it seldom ends an answer with the "User:" stop the recipe's
format reward asks for within a few tokens, every group scores alike and nothing is learnt.

Measured in one run, one after the other on the same machine:
  recipe      `flywheel up --with tinker --model M` (trainer with LoRA adapters, a transformers-engine
              rollout, the gateway), then `python -m tinker_cookbook.recipes.math_rl.train
              env=arithmetic renderer_name=role_colon loss_fn=importance_sampling` against it
              (tinker-cookbook 0.6.1; requirements/tinker-cookbook.txt): sample the batch through
              the gateway's sampler, score, forward_backward + optim_step, save for the sampler.
              Its reward per step is the cookbook's `env/all/reward/total` (correct answer, minus
              0.1 without the stop sequence), its seconds per step `time/total`.
  controller  `python -m services.controller run` on a config made here: the same model, LoRA
              rank and modules, engine kind, batch (groups x group size), temperature, token
              limit and learning rate, sync mode, every core to the trainer, on "What is x + y?"
              questions (x, y in 1..100: our arithmetic generator), asked bare in the model's chat
              template (the recipe adds one example exchange before it); its seconds per step are
              its `time/step_seconds`.
The first step of each is left out of the medians (model loading, first compilations).
gateway_recipe_step_vs_controller_step is the recipe's median step over the controller's: what
driving the loop through the Tinker API costs against our own loop (lower is better). Ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.cli import TINKER_LORA_MODULES  # noqa: E402
from flywheel.testing.machine import cpu  # noqa: E402
from flywheel.testing.records import commit, record  # noqa: E402

#: The line `flywheel up --with tinker` prints once the gateway answers.
_READY = re.compile(r"TINKER_BASE_URL=(?P<url>\S+) \(base_model (?P<model>[^)]+)\)")


def parse_args() -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--steps", type=int, default=20, help="recipe steps")
    parser.add_argument("--controller-steps", type=int, default=6, help="controller steps (for its step time)")
    parser.add_argument("--groups", type=int, default=8, help="questions per batch (groups_per_batch)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=5, help="the recipe's default for arithmetic")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=1.0, help="the recipe's default")
    parser.add_argument("--renderer", default="role_colon",
                        help="the recipe's renderer_name; SmolLM2 speaks ChatML, which qwen3_instruct renders")
    parser.add_argument("--lora-rank", type=int, default=32)
    return parse_with_smoke(parser, "the tiny model, 2 steps each (CI)",
                            model="tiny", steps=2, controller_steps=2, groups=2, group_size=2)


def model_dir(kind: str, work: Path) -> Path:
    if kind == "tiny":
        from flywheel.models.tiny import build_tiny_model

        return build_tiny_model(work / "tiny", max_position_embeddings=512)
    from services.controller.launcher.prepare import prepare_model
    from services.controller.launcher.spec import ModelSource

    return prepare_model(ModelSource(source="smollm2", dtype="float32"))


def start_gateway(model: Path, lora_rank: int, work: Path) -> tuple[subprocess.Popen, str, str]:
    """`flywheel up --with tinker`, once it prints the Tinker API's address: (process, url, base_model)."""
    up = subprocess.Popen(
        [sys.executable, "-m", "flywheel.cli", "up", "--with", "tinker", "--model", str(model), "--lora-rank",
         str(lora_rank), "--tinker-port", "0", "--status-port", "0", "--run-dir", str(work / "up")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    deadline = time.monotonic() + 600
    for line in up.stdout:
        seen.append(line)
        match = _READY.search(line)
        if match:
            return up, match["url"], match["model"]
        if time.monotonic() > deadline:
            break
    up.kill()
    raise SystemExit("flywheel up --with tinker did not start:\n" + "".join(seen[-40:]))


def stop(up: subprocess.Popen) -> None:
    os.killpg(up.pid, signal.SIGINT)
    try:
        up.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)


def run_recipe(args: argparse.Namespace, url: str, base_model: str, work: Path) -> list[dict]:
    log_path = work / "recipe"
    command = [
        sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={base_model}",
        f"lora_rank={args.lora_rank}", f"renderer_name={args.renderer}", "loss_fn=importance_sampling",
        f"base_url={url}", f"groups_per_batch={args.groups}", f"group_size={args.group_size}",
        f"max_tokens={args.max_tokens}", f"learning_rate={args.learning_rate}", f"max_steps={args.steps}",
        f"temperature={args.temperature}",
        "eval_every=0", "save_every=0", f"log_path={log_path}", "behavior_if_log_dir_exists=delete"]
    env = {**os.environ, "TINKER_API_KEY": "tml-bench"}
    proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"the recipe failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "env/all/reward/total" in r]


def run_controller(args: argparse.Namespace, model: Path, work: Path) -> list[float]:
    samples = args.groups * args.group_size
    config = {
        "run": {"name": "bench-tinker-recipe", "seed": 0, "max_steps": args.controller_steps},
        "launch": {
            "model": {"source": "path", "path": str(model)},
            "dataset": {"generator": "arithmetic", "train_size": args.groups * args.controller_steps,
                        "validation_size": 8, "max_operand": 100, "operations": ["+"], "terms": [2]},
            # every core for the trainer, as `flywheel up` gives the gateway's (the launcher's default is half:
            # it expects the engine to run beside the trainer, which sync mode does not do)
            "trainer": {"optimizer": {"lr": args.learning_rate},
                        "model": {"cpu_threads": 0, "lora": {"enabled": True, "rank": args.lora_rank,
                                                             "target_modules": json.loads(TINKER_LORA_MODULES)}}},
            # the engine `flywheel up` gives the gateway's rollout
            "rollout": {"engine": {"kind": "transformers"}},
        },
        "data": {"train": {"prompt_key": "question", "answer_key": "answer"},
                 "validation": {"prompt_key": "question", "answer_key": "answer", "shuffle": False}},
        # the bare question in the model's chat template, as the recipe's prompt is (no instruction, no system)
        "worker": {"type": "math", "group_size": args.group_size, "max_in_flight": args.groups,
                   "system_prompt": "", "instruction": "",
                   "sampling": {"temperature": args.temperature, "max_tokens": args.max_tokens}},
        "reward": {"name": "math"},
        "algorithm": {"name": "grpo", "train_batch_size": samples},
        "mode": "sync", "resume": "disable",
        "validation": {"before_training": False, "interval": 0},
        "checkpoint": {"interval": 0, "at_end": False},
    }
    config_file = work / "controller.yaml"
    config_file.write_text(yaml.safe_dump(config))
    run_dir = work / "controller"
    proc = subprocess.run([sys.executable, "-m", "services.controller", "run", str(config_file), "--run-dir",
                           str(run_dir)], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"the controller run failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_seconds" in r]


def after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tinker-recipe-") as tmp:
        work = Path(tmp)
        model = model_dir(args.model, work)
        up, url, base_model = start_gateway(model, args.lora_rank, work)
        try:
            rows = run_recipe(args, url, base_model, work)
        finally:
            stop(up)
        # the gateway's own copy, its output head untied (an adapter on the head needs one; flywheel up made it)
        controller = run_controller(args, Path(base_model), work)
    print(f"{'step':>4} {'reward':>8} {'correct':>8} {'seconds':>8}")
    for row in rows:
        print(f"{row['step']:>4} {row['env/all/reward/total']:>8.3f} {row.get('env/all/correct', 0.0):>8.3f} "
              f"{row['time/total']:>8.2f}")
    recipe_step = after_first([r["time/total"] for r in rows])
    controller_step = after_first([r["time/step_seconds"] for r in controller])
    # the training part of a step: the same trainer calls either way
    recipe_train = after_first([r["time/train_step"] for r in rows])
    controller_train = after_first([r["train/step_seconds"] for r in controller])
    print(f"recipe through the gateway: {recipe_step:.2f} s/step ({recipe_train:.2f} s training); our controller, "
          f"same batch: {controller_step:.2f} s/step ({controller_train:.2f} s training)")
    ratio = recipe_step / controller_step
    print(f"gateway_recipe_step_vs_controller_step {ratio:.3f} (time: lower is better)")
    rewards = [round(r["env/all/reward/total"], 4) for r in rows]
    record("tinker_recipe", {
        **cpu(), "commit": commit(), "model": args.model, "steps": len(rows), "groups": args.groups,
        "group_size": args.group_size, "max_tokens": args.max_tokens, "learning_rate": args.learning_rate,
        "temperature": args.temperature, "renderer": args.renderer,
        "lora_rank": args.lora_rank, "reward_per_step": rewards,
        "correct_per_step": [round(r.get("env/all/correct", 0.0), 4) for r in rows],
        "recipe_step_seconds": round(recipe_step, 3), "controller_step_seconds": round(controller_step, 3),
        "recipe_train_seconds": round(recipe_train, 3), "controller_train_seconds": round(controller_train, 3),
        "gateway_recipe_step_vs_controller_step": round(ratio, 4)}, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
