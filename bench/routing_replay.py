"""Mixture-of-experts routing replay: the trainer-rollout gap with the rollout's routing replayed vs not.

Run manual:
    python bench/routing_replay.py            # ~1 min on 2 cores: 16 prompts x 4 samples x 64 tokens
    python bench/routing_replay.py --smoke    # seconds after the model is built: checks it runs (CI)

What runs: a tiny random Qwen3-MoE (flywheel.models.tiny, arch qwen3_moe: 2 MoE layers of 8 experts,
2 routed per token; --init-std 0.05 so that the experts' outputs, and so a flipped pick, matter next to
the bfloat16 rounding of the dense layers), served by the rollout's transformers engine in float32,
which samples (temperature 1, the raw distribution) and records the experts each router chose for
every token it fed. The trainer's engine (services.trainer.training.TrainingEngine, the same code the
trainer service runs) then takes its log-probs of the sampled tokens in a forward-only pass under
bfloat16 autocast (model.autocast bfloat16): once with model.routing_replay on (its routers take the
recorded ids, the gate weights from their own logits), once off (they route anew).

The pair of settings is where flips happen: the routers' logits under bfloat16 autocast differ from
the float32 engine's by their rounding, and a token whose k-th and (k+1)-th experts are that close
flips. A control row runs the trainer in float32 (no autocast): no flips, the gap is the kernels'.

Reported: routing_flip_fraction (of the recorded routing decisions, token x layer x slot, those the
trainer's routers make otherwise, from the trainer's own metric), the mean trainer-rollout KL over
the sampled tokens with and without replay (k3: E[r - 1 - log r], r the trainer/rollout probability
ratio of the sampled token), and kl_with_replay_vs_without, their ratio (goal <= 0.1). Ends with one
JSON line (flywheel.testing.records.record).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.common.types import SamplingSpec  # noqa: E402
from flywheel.models.tiny import build_tiny_model  # noqa: E402
from flywheel.testing.records import record  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__)
    sampling = ap.add_argument_group("sampling")
    sampling.add_argument("--prompts", type=int, default=16, help="prompts sampled")
    sampling.add_argument("--samples", type=int, default=4, help="samples per prompt")
    sampling.add_argument("--tokens", type=int, default=64, help="completion tokens per sample")
    sampling.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt (random ids)")
    model = ap.add_argument_group("the tiny MoE")
    model.add_argument("--init-std", type=float, default=0.05, help="its weight init std")
    model.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    ap.add_argument("--seed", type=int, default=0)
    return parse_with_smoke(ap, "4 prompts x 2 samples x 16 tokens: checks the bench runs",
                            prompts=4, samples=2, tokens=16)


async def sample(model: Path, args: argparse.Namespace) -> list:
    """The rollout's transformers engine in float32: finished samples with their recorded routing."""
    from services.rollout.engine.text import TextCodec
    from services.rollout.engine.transformers_engine import TransformersEngine

    codec = TextCodec.load(model)
    engine = TransformersEngine(model, {"dtype": "float32", "max_model_len": 512, "seed": args.seed}, codec)
    await engine.start()
    generator = torch.Generator().manual_seed(args.seed)
    spec = SamplingSpec(n=args.samples, temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=args.seed)

    async def one(i: int) -> list:
        prompt = torch.randint(1, engine.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
        done = []
        async for deltas in engine.generate(f"p{i}", prompt, spec, stream=False):
            done += [(prompt, d.final) for d in deltas if d.final is not None]
        return done

    try:
        results = await asyncio.gather(*(one(i) for i in range(args.prompts)))
    finally:
        await engine.stop()
    return [s for r in results for s in r]


def batch_of(samples: list) -> dict[str, torch.Tensor]:
    """The TrainBatch tensors the controller would build (services.controller.batches.batching's layout)."""
    width = max(len(p) + len(s.token_ids) for p, s in samples)
    b = len(samples)
    routed0 = samples[0][1].routed_experts
    ids = torch.zeros(b, width, dtype=torch.int64)
    attention = torch.zeros(b, width, dtype=torch.int64)
    mask = torch.zeros(b, width)
    behaviour = torch.zeros(b, width)
    routed = torch.full((b, width, *routed0.shape[1:]), 255, dtype=routed0.dtype)
    for row, (prompt, s) in enumerate(samples):
        p, c = len(prompt), len(s.token_ids)
        ids[row, :p + c] = torch.tensor(prompt + s.token_ids)
        attention[row, :p + c] = 1
        mask[row, p:p + c] = 1
        behaviour[row, p:p + c] = torch.tensor(s.logprobs)
        routed[row, :s.routed_experts.shape[0]] = s.routed_experts
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": mask, "advantages": torch.zeros(b),
            "behaviour_logprobs": behaviour, "routed_experts": routed}


def trainer_pass(model: Path, tensors: dict[str, torch.Tensor], *, autocast: str, replay: bool, work: Path) -> dict:
    """One forward-only pass of the trainer's engine: its log-probs of the sampled tokens and its metrics."""
    from services.trainer.config import TrainerConfig
    from services.trainer.loss_request import LossRequest
    from services.trainer.training import TrainingEngine

    config = TrainerConfig.model_validate({
        "model": {"path": str(model), "autocast": autocast, "routing_replay": replay},
        "checkpoint": {"dir": str(work / "ckpt")},
    })
    engine = TrainingEngine(config)
    engine.load()
    started = time.perf_counter()
    out = engine.forward_backward(tensors, LossRequest(kind="importance_sampling"), forward_only=True)
    seconds = time.perf_counter() - started
    engine.close()
    mask = tensors["loss_mask"] > 0
    log_ratio = out.logprobs[mask] - tensors["behaviour_logprobs"][mask]
    kl = float((log_ratio.exp() - 1 - log_ratio).mean())
    return {"routing_flip_fraction": out.metrics.get("routing_flip_fraction", 0.0), "kl": kl,
            "max_abs_logprob_diff": float(log_ratio.abs().max()), "seconds": round(seconds, 3)}


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="routing-replay-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "moe", arch="qwen3_moe", init_std=args.init_std, num_experts=args.experts,
                                 seed=args.seed)
        samples = asyncio.run(sample(model, args))
        tensors = batch_of(samples)
        rows = {
            "bf16_without_replay": trainer_pass(model, tensors, autocast="bfloat16", replay=False, work=work),
            "bf16_with_replay": trainer_pass(model, tensors, autocast="bfloat16", replay=True, work=work),
            "fp32_without_replay": trainer_pass(model, tensors, autocast="none", replay=False, work=work),
        }
    tokens = int(tensors["loss_mask"].sum())
    print(f"tiny Qwen3-MoE (2 layers x {args.experts} experts, top-2, init std {args.init_std}); rollout: transformers "
          f"engine, float32; {len(samples)} samples, {tokens} sampled tokens")
    print(f"{'trainer':<22}{'flips':>9}{'KL (k3)':>12}{'max |dlp|':>11}")
    for name, r in rows.items():
        print(f"{name:<22}{r['routing_flip_fraction']:>9.2%}{r['kl']:>12.3e}{r['max_abs_logprob_diff']:>11.4f}")
    without, with_ = rows["bf16_without_replay"], rows["bf16_with_replay"]
    figures = {
        "workload": {"model": "tiny qwen3_moe", "experts": args.experts, "top_k": 2, "layers": 2,
                     "init_std": args.init_std, "rollout": "transformers engine, float32",
                     "trainer": "TrainingEngine, bfloat16 autocast", "samples": len(samples), "sampled_tokens": tokens},
        "routing_flip_fraction": without["routing_flip_fraction"],
        "kl_without_replay": without["kl"],
        "kl_with_replay": with_["kl"],
        "kl_float32_trainer": rows["fp32_without_replay"]["kl"],
        "rows": rows,
        "kl_with_replay_vs_without": with_["kl"] / max(without["kl"], 1e-30),
    }
    record("routing_replay", figures, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
