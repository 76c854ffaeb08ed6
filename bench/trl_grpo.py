"""The quickstart against TRL's GRPOTrainer: the same job on the same machine, one process each.

Run manual (~25 minutes on 2 cores):
    python bench/trl_grpo.py                  # 10 steps each, held-out accuracy at steps 0 and 10
    python bench/trl_grpo.py --steps 20
    python bench/trl_grpo.py --smoke          # 2 steps each on the tiny model, our side on the transformers engine (CI)

Ours: `python -m services.controller run examples/quickstart.yaml --max-steps N` in a fresh
run directory (services started, vLLM on CPU, the quickstart's mode and learning-rate
schedule decaying over the N steps as TRL's does, greedy validation of the 200 held-out
questions before training and at the end). Baseline: TRL 1.16's GRPOTrainer on the
same job, as a single-machine TRL user without a GPU runs it (generation through transformers'
`generate`, `use_cpu`): the same model file, the same training questions (the run directory's
data), system prompt and chat template, 8 questions x 8 samples per step (per-device batch 16
x 4 accumulation steps = one generation of 64), learning rate 1e-5, temperature 0.7, 64
completion tokens, the same reward (our math scorer), TRL's defaults otherwise; its held-out
accuracy is measured the same way (greedy, 64 tokens, our scorer) before training and at the
end, through transformers' `generate` in batches of 50, inside its timed run.

Both wall times run from process start to end: model loading, the first step and every
validation pass included. Reported: seconds per step of each (wall / steps), held-out
accuracy before and after of each, and `flywheel_step_vs_trl_step` (TRL's seconds per step
over ours; the goal is >= 2), with the CPU (flywheel/testing/machine.py). One JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.testing.engines import with_transformers_engine  # noqa: E402
from flywheel.testing.machine import cpu  # noqa: E402
from flywheel.testing.records import record  # noqa: E402
from services.controller.tasks.answers import answers_match, final_answer  # noqa: E402

QUICKSTART = ROOT / "examples" / "quickstart.yaml"
VALIDATION_BATCH = 50


def job_config(smoke: bool, work: Path, steps: int) -> Path:
    """The quickstart (or, for --smoke, the quickstart on the tiny model with 16 held-out questions)."""
    config = yaml.safe_load(QUICKSTART.read_text())
    config["run"]["max_steps"] = steps
    config["checkpoint"] = {"interval": 0, "at_end": False}
    config["validation"]["interval"] = steps
    if smoke:
        config["launch"]["model"] = {"source": "tiny", "dtype": "float32"}
        config["launch"]["dataset"].update(train_size=32, validation_size=16)
        config["launch"]["rollout"]["engine"]["args"].update(max_model_len=256, kv_cache_memory_bytes=64 * 2**20)
        config["worker"]["sampling"]["max_tokens"] = 16
        config["validation"]["sampling"]["max_tokens"] = 16
        with_transformers_engine(config)  # it checks the bench runs: vLLM's start would be half its time
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_ours(config: Path, run_dir: Path) -> dict:
    command = [sys.executable, "-m", "services.controller", "run", str(config), "--run-dir", str(run_dir),
               "--resume", "disable"]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"our job failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    steps = sum(1 for r in rows if "rollout/reward_mean" in r)
    return {"wall_seconds": round(wall, 1), "steps": steps, "val_before": validations[0], "val_after": validations[-1]}


def run_trl(config_path: Path, run_dir: Path, steps: int, work: Path) -> dict:
    """TRL's GRPOTrainer on the job `config_path` describes, with the data our run generated."""
    started = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.controller.launcher.prepare import prepare_model
    from services.controller.launcher.spec import split_run_file

    raw = yaml.safe_load(config_path.read_text())
    spec, run = split_run_file(raw, f"file {config_path}")
    model_dir = prepare_model(spec.model)  # type: ignore[attr-defined]
    worker = run["worker"]
    system = worker.get("system_prompt")
    instruction = worker.get("instruction")
    group, batch = int(worker["group_size"]), int(run["algorithm"]["train_batch_size"])
    sampling = worker["sampling"]

    def messages(question: str) -> list[dict]:
        user = f"{question}\n{instruction}" if instruction else question
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (run_dir / "data" / f"{name}.jsonl").read_text().splitlines()]

    train = Dataset.from_list([{"prompt": messages(r["question"]), "answer": r["answer"]} for r in rows("train")])
    held_out = rows("validation")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def accuracy_reward(completions: list, answer: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(answers_match(final_answer(t)[0], a)) for t, a in zip(texts, answer)]

    def held_out_accuracy() -> float:
        model.eval()
        correct = 0
        with torch.no_grad():
            for start in range(0, len(held_out), VALIDATION_BATCH):
                part = held_out[start:start + VALIDATION_BATCH]
                prompts = [tokenizer.apply_chat_template(messages(r["question"]), add_generation_prompt=True,
                                                         tokenize=False) for r in part]
                enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, do_sample=False,
                                     max_new_tokens=int(run["validation"]["sampling"]["max_tokens"]),
                                     pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
                for r, ids in zip(part, out[:, enc["input_ids"].shape[1]:]):
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    correct += answers_match(final_answer(text)[0], r["answer"])
        model.train()
        return correct / len(held_out)

    before = held_out_accuracy()
    micro = min(16, batch)
    args = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, num_generations=group,
        max_completion_length=int(sampling["max_tokens"]), temperature=float(sampling.get("temperature", 1.0)),
        learning_rate=float(spec.trainer["optimizer"]["lr"]),  # type: ignore[attr-defined]
        use_cpu=True, logging_steps=1, save_strategy="no", report_to="none", seed=int(run["run"].get("seed", 0)),
    )

    class Rewards(TrainerCallback):
        rewards: list[float] = []

        def on_log(self, _args, _state, _control, logs=None, **_):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    trainer = GRPOTrainer(model=model, reward_funcs=accuracy_reward, args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=[Rewards()])
    trainer.train()
    after = held_out_accuracy()
    return {"wall_seconds": round(time.monotonic() - started, 1), "steps": steps, "val_before": before,
            "val_after": after, "reward_first": Rewards.rewards[0] if Rewards.rewards else None,
            "reward_last": Rewards.rewards[-1] if Rewards.rewards else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="2 steps each on the tiny model")
    args = parser.parse_args()
    steps = 2 if args.smoke else args.steps
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        work = Path(tmp)
        config = job_config(args.smoke, work, steps)
        ours = run_ours(config, work / "ours")
        print({"flywheel": ours}, flush=True)
        trl = run_trl(config, work / "ours", steps, work)
        print({"trl": trl}, flush=True)
    ours_step, trl_step = ours["wall_seconds"] / ours["steps"], trl["wall_seconds"] / trl["steps"]
    figures = {
        "bench": "trl_grpo", **cpu(), "steps": steps, "model": "tiny" if args.smoke else "smollm2",
        "flywheel_seconds_per_step": round(ours_step, 2), "trl_seconds_per_step": round(trl_step, 2),
        "flywheel_val_before": ours["val_before"], "flywheel_val_after": ours["val_after"],
        "trl_val_before": round(trl["val_before"], 4), "trl_val_after": round(trl["val_after"], 4),
        "trl_reward_first": trl["reward_first"], "trl_reward_last": trl["reward_last"],
        "flywheel_step_vs_trl_step": round(trl_step / ours_step, 3),
    }
    record("trl_grpo", figures, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
