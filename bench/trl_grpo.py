"""The quickstart against TRL's GRPOTrainer: the same job on the same machine, one process each.

Run manual (~25 minutes on 2 cores):
    python bench/trl_grpo.py                  # 10 steps each, seed 0, held-out accuracy at steps 0 and 10
    python bench/trl_grpo.py --seed 1         # another seed on both sides (run 0, 1, 2 for the published rows)
    python bench/trl_grpo.py --steps 20
    python bench/trl_grpo.py --smoke          # 2 steps each on the tiny model, our side on the transformers engine (CI)
Experiments (one variable at a time, same seeds; keep their records apart from the published ones):
    FLYWHEEL_BENCH_RESULTS=bench/results/experiments python bench/trl_grpo.py --side flywheel \
        --set algorithm.loss.aggregation=token_mean --note "ours with TRL's token-level aggregation"
    FLYWHEEL_BENCH_RESULTS=bench/results/experiments python bench/trl_grpo.py --trl loss_type=grpo

Ours: `python -m services.controller run examples/quickstart.yaml --max-steps N --seed S` in a
fresh run directory (services started, vLLM on CPU, the quickstart's mode and learning-rate
schedule decaying over the N steps as TRL's does, greedy validation of the 200 held-out
questions before training and at the end). Baseline: TRL 1.16's GRPOTrainer on the same job, as
a single-machine TRL user without a GPU runs it (generation through transformers' `generate`,
`use_cpu`, TRL's defaults otherwise: loss_type "dapo", beta 0, scale_rewards "group", bf16
autocast where the CPU computes bfloat16 natively; on one that emulates it (AVX2 only), `bf16`
False, as our `autocast: auto` does there: emulated, a step takes many times as long, and no user
would keep it; `trl_bf16` says which ran): the same model file, system prompt and chat template,
the same questions in the same order (the ones our run trained, step by step, from its
trained_tasks.jsonl; TRL's shuffling off), 8 questions x 8 samples per step (per-device batch 16 x 4 accumulation steps = one generation
of 64), learning rate 1e-5 decaying linearly over the N steps, temperature 0.7, the run file's
completion length (48 tokens), the same reward (our math scorer), seed S. TRL's held-out accuracy
is measured with our scorer before training and at the end (greedy, 64 tokens) through
transformers' `generate` in batches of 50; our final checkpoint is also measured that way
(`flywheel_val_after_hf`), so the two sides' final accuracies can be read with one evaluator.

Times, each side from its process start to end: `*_train_seconds` the training steps alone
(ours: the steps' wall time, validation passes between them taken out; TRL's: `trainer.train()`),
`*_validation_seconds` the validation passes (before and after training), `*_setup_seconds` the
rest (imports, services starting, model loading, our final checkpoint, stopping). Ratios (TRL's
time over ours, above 1 is faster): `flywheel_train_step_vs_trl_train_step` (training alone),
`flywheel_validation_vs_trl_validation` and `flywheel_step_vs_trl_step` (wall / steps: the goal
is >= 2). The machine is named (flywheel/testing/machine.py), with its 1-minute load average at
the start and the end (`load_average`): wall times are noisy on a shared machine, accuracies are
not. One JSON line at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.models.precision import native_bfloat16  # noqa: E402
from flywheel.testing.engines import with_transformers_engine  # noqa: E402
from flywheel.testing.machine import cpu  # noqa: E402
from flywheel.testing.records import record  # noqa: E402
from services.controller.tasks.answers import answers_match, final_answer  # noqa: E402

QUICKSTART = ROOT / "examples" / "quickstart.yaml"
VALIDATION_BATCH = 50


def override(tree: dict[str, Any], assignment: str) -> None:
    """Sets `a.b.c=VALUE` (VALUE read as YAML) in `tree`, making the sections on the way."""
    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set/--trl takes KEY=VALUE, not {assignment!r}")
    *path, last = key.split(".")
    for part in path:
        tree = tree.setdefault(part, {})
    tree[last] = yaml.safe_load(value)


def job_config(smoke: bool, work: Path, steps: int, seed: int, sets: list[str]) -> Path:
    """The quickstart (or, for --smoke, the quickstart on the tiny model with 16 held-out questions)."""
    config = yaml.safe_load(QUICKSTART.read_text())
    config["run"]["max_steps"] = steps
    config["run"]["seed"] = seed
    # The final weights are kept, so that TRL's evaluator can read them too (flywheel_val_after_hf).
    config["checkpoint"] = {"interval": 0, "at_end": True}
    config["validation"]["interval"] = steps
    if smoke:
        config["launch"]["model"] = {"source": "tiny", "dtype": "float32"}
        config["launch"]["dataset"].update(train_size=32, validation_size=16)
        config["launch"]["rollout"]["engine"]["args"].update(max_model_len=256, kv_cache_memory_bytes=64 * 2**20)
        config["worker"]["sampling"]["max_tokens"] = 16
        config["validation"]["sampling"]["max_tokens"] = 16
        with_transformers_engine(config)  # it checks the bench runs: vLLM's start would be half its time
    for assignment in sets:
        override(config, assignment)
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_ours(config: Path, run_dir: Path, expected_steps: int) -> dict:
    command = [sys.executable, "-m", "services.controller", "run", str(config), "--run-dir", str(run_dir),
               "--resume", "disable"]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"our job failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return read_ours(run_dir, expected_steps, wall)


def read_ours(run_dir: Path, expected_steps: int, wall: float) -> dict:
    """Our run's figures from its run directory; an error when it did not run every step and validation."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    validations = [r for r in rows if "val/accuracy" in r]
    last = max((int(r["step"]) for r in steps), default=0)
    failed = [r for r in rows if r.get("val/failed")]
    # A run that ends early (a rollout engine that died fails every task, and the data runs out) still exits 0.
    if last != expected_steps or not validations or int(validations[-1]["step"]) != last or failed:
        raise SystemExit(f"our job did not run as asked: {last} of {expected_steps} steps, validations at steps "
                         f"{[int(r['step']) for r in validations]}, failed validation rows {failed}; see "
                         f"{run_dir}/controller.log and rollout.log (--keep DIR keeps them)")
    validation = sum(r["val/seconds"] for r in validations)
    # A step's time runs from the record before it: a validation pass between two steps is in it.
    train = sum(r["time/step_seconds"] for r in steps) - sum(r["val/seconds"] for r in validations
                                                             if int(r["step"]) < last)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"wall_seconds": wall, "train_seconds": train, "validation_seconds": validation,
            "steps": len(steps), "val_before": validations[0]["val/accuracy"],
            "val_after": validations[-1]["val/accuracy"],
            "rewards": [r["rollout/reward_mean"] for r in steps],
            "lengths": [r["rollout/response_length_mean"] for r in steps],
            "model": summary.get("model") or ""}


def trained_order(run_dir: Path) -> list[int]:
    """The training questions our run trained, step by step (indices into train.jsonl)."""
    order: list[int] = []
    lines = (run_dir / "trained_tasks.jsonl").read_text().splitlines()
    by_step: dict[int, list[str]] = {}
    for line in lines:
        row = json.loads(line)
        by_step[int(row["step"])] = row["tasks"]  # a redone step's later line is the one trained on
    for step in sorted(by_step):
        order += [int(task.rsplit(":", 1)[1]) for task in by_step[step]]
    return order


class Evaluator:
    """Greedy held-out accuracy through transformers' `generate` (our scorer, batches of 50)."""

    def __init__(self, run: dict, run_dir: Path, tokenizer: Any) -> None:
        worker = run["worker"]
        self.system, self.instruction = worker.get("system_prompt"), worker.get("instruction")
        self.max_tokens = int(run["validation"]["sampling"]["max_tokens"])
        self.tokenizer = tokenizer
        self.held_out = rows(run_dir, "validation")

    def messages(self, question: str) -> list[dict]:
        user = f"{question}\n{self.instruction}" if self.instruction else question
        return ([{"role": "system", "content": self.system}] if self.system else []) + [{"role": "user", "content": user}]

    def accuracy(self, model: Any) -> float:
        import torch

        tok = self.tokenizer
        was_training = model.training
        model.eval()
        correct = 0
        with torch.no_grad():
            for start in range(0, len(self.held_out), VALIDATION_BATCH):
                part = self.held_out[start:start + VALIDATION_BATCH]
                prompts = [tok.apply_chat_template(self.messages(r["question"]), add_generation_prompt=True,
                                                   tokenize=False) for r in part]
                enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, do_sample=False, max_new_tokens=self.max_tokens,
                                     pad_token_id=tok.pad_token_id or tok.eos_token_id)
                for r, ids in zip(part, out[:, enc["input_ids"].shape[1]:]):
                    text = tok.decode(ids, skip_special_tokens=True)
                    correct += answers_match(final_answer(text)[0], r["answer"])
        model.train(was_training)
        return correct / len(self.held_out)


def rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "data" / f"{name}.jsonl").read_text().splitlines()]


def load_job(config_path: Path) -> tuple[Any, dict, Path]:
    from services.controller.launcher.prepare import prepare_model
    from services.controller.launcher.spec import split_run_file

    spec, run = split_run_file(yaml.safe_load(config_path.read_text()), f"file {config_path}")
    return spec, run, prepare_model(spec.model)  # type: ignore[attr-defined]


def evaluate_checkpoint(config_path: Path, run_dir: Path, model_path: str) -> float | None:
    """Our final weights' held-out accuracy through TRL's side's evaluator."""
    if not model_path or not Path(model_path).is_dir():
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run, model_dir = load_job(config_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return Evaluator(run, run_dir, tokenizer).accuracy(model)


def run_trl(config_path: Path, run_dir: Path, steps: int, seed: int, work: Path, trl_sets: list[str]) -> dict:
    """TRL's GRPOTrainer on the job `config_path` describes, with the data (and question order) our run had."""
    started = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec, run, model_dir = load_job(config_path)
    worker = run["worker"]
    group, batch = int(worker["group_size"]), int(run["algorithm"]["train_batch_size"])
    sampling = worker["sampling"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    evaluator = Evaluator(run, run_dir, tokenizer)
    train_rows = rows(run_dir, "train")
    order = trained_order(run_dir) if (run_dir / "trained_tasks.jsonl").exists() else []
    order = order[: steps * (batch // group)] or list(range(len(train_rows)))
    train = Dataset.from_list([{"prompt": evaluator.messages(train_rows[i]["question"]),
                                "answer": train_rows[i]["answer"]} for i in order])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def accuracy_reward(completions: list, answer: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(answers_match(final_answer(t)[0], a)) for t, a in zip(texts, answer)]

    setup = time.monotonic() - started
    t0 = time.monotonic()
    before = evaluator.accuracy(model)
    validation = time.monotonic() - t0
    micro = min(16, batch)
    settings: dict[str, Any] = dict(
        output_dir=str(work / "trl"), max_steps=steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, num_generations=group,
        max_completion_length=int(sampling["max_tokens"]), temperature=float(sampling.get("temperature", 1.0)),
        learning_rate=float(spec.trainer["optimizer"]["lr"]),  # type: ignore[attr-defined]
        use_cpu=True, logging_steps=1, save_strategy="no", report_to="none", seed=seed,
        shuffle_dataset=False,  # the questions in our run's order
        bf16=native_bfloat16("cpu"),  # TRL's default (True) only where the CPU has it: see the docstring
    )
    for assignment in trl_sets:
        override(settings, assignment)
    args = GRPOConfig(**settings)

    class Logs(TrainerCallback):
        rewards: list[float] = []
        lengths: list[float] = []

        def on_log(self, _args, _state, _control, logs=None, **_):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
                self.lengths.append(float(logs.get("completions/mean_length", float("nan"))))

    trainer = GRPOTrainer(model=model, reward_funcs=accuracy_reward, args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=[Logs()])
    t0 = time.monotonic()
    trainer.train()
    train_seconds = time.monotonic() - t0
    t0 = time.monotonic()
    after = evaluator.accuracy(model)
    validation += time.monotonic() - t0
    wall = time.monotonic() - started
    return {"wall_seconds": wall, "train_seconds": train_seconds, "validation_seconds": validation,
            "setup_seconds": setup, "steps": steps, "val_before": before, "val_after": after,
            "rewards": Logs.rewards, "lengths": Logs.lengths, "bf16": bool(args.bf16)}


def side_figures(name: str, side: dict) -> dict[str, Any]:
    steps = side["steps"]
    other = side["wall_seconds"] - side["train_seconds"] - side["validation_seconds"]
    return {
        f"{name}_seconds_per_step": round(side["wall_seconds"] / steps, 2),
        f"{name}_train_seconds": round(side["train_seconds"], 1),
        f"{name}_train_seconds_per_step": round(side["train_seconds"] / steps, 2),
        f"{name}_validation_seconds": round(side["validation_seconds"], 1),
        f"{name}_setup_seconds": round(other, 1),
        f"{name}_val_before": round(side["val_before"], 4), f"{name}_val_after": round(side["val_after"], 4),
        f"{name}_reward_first": round(side["rewards"][0], 4) if side["rewards"] else None,
        f"{name}_reward_last": round(side["rewards"][-1], 4) if side["rewards"] else None,
        f"{name}_rewards": [round(r, 3) for r in side["rewards"]],
        f"{name}_lengths": [round(n, 1) for n in side["lengths"]],
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=10, help="training steps each side (default 10; smoke 2)")
    parser.add_argument("--seed", type=int, default=0, help="run.seed on our side, GRPOConfig.seed on TRL's")
    parser.add_argument("--side", choices=("both", "flywheel", "trl"), default="both",
                        help="run one side only (experiments; TRL's side still needs our run's data: ours runs "
                        "first, untimed)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override our run file (dotted key, YAML value), e.g. algorithm.loss.aggregation=token_mean")
    parser.add_argument("--trl", dest="trl_sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a GRPOConfig field, e.g. loss_type=grpo")
    parser.add_argument("--note", default=None, help="what a reader needs to read the record right")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="work in DIR and keep it (our run directory, TRL's output), instead of a temporary one")
    args = parse_with_smoke(parser, "2 steps each on the tiny model, our side on the transformers engine (CI)", steps=2)
    steps = args.steps
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    figures: dict[str, Any] = {"bench": "trl_grpo", **cpu(), "steps": steps, "seed": args.seed,
                               "model": "tiny" if args.smoke else "smollm2"}
    # The machine's 1-minute load average at the start and the end: other work on it moves the times.
    load = [round(os.getloadavg()[0], 2)]
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        work = args.keep or Path(tmp)
        config = job_config(args.smoke, work, steps, args.seed, args.sets)
        ours = run_ours(config, work / "ours", steps)
        print({"flywheel": ours}, flush=True)
        if args.side in ("both", "flywheel"):
            figures.update(side_figures("flywheel", ours))
            after_hf = evaluate_checkpoint(config, work / "ours", ours["model"])
            figures["flywheel_val_after_hf"] = None if after_hf is None else round(after_hf, 4)
        if args.side in ("both", "trl"):
            trl = run_trl(config, work / "ours", steps, args.seed, work, args.trl_sets)
            print({"trl": trl}, flush=True)
            figures.update(side_figures("trl", trl), trl_bf16=trl["bf16"])
    figures["load_average"] = load + [round(os.getloadavg()[0], 2)]
    if args.side == "both":
        figures["flywheel_step_vs_trl_step"] = round(figures["trl_seconds_per_step"] /
                                                     figures["flywheel_seconds_per_step"], 3)
        figures["flywheel_train_step_vs_trl_train_step"] = round(trl["train_seconds"] / ours["train_seconds"], 3)
        figures["flywheel_validation_vs_trl_validation"] = round(trl["validation_seconds"] /
                                                                 ours["validation_seconds"], 3)
    record("trl_grpo", figures, args=args, smoke=args.smoke, note=args.note)


if __name__ == "__main__":
    main()
