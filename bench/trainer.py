"""TrainStep throughput through the trainer service vs the same step in-process.

Run manual:
    python bench/trainer.py                          # small Qwen2 on CPU, B=8, T=256
    python bench/trainer.py --layers 2 --hidden 128 --seq-len 128 --steps 10
    python bench/trainer.py --threads 1              # steadier on a busy shared machine
    python bench/trainer.py --device cuda:0 --layers 8 --hidden 512 --batch-size 16
    python bench/trainer.py --smoke  # seconds: checks it runs (CI)

Measured in the same run, on the same model directory and the same batch:
  service     `python -m services.trainer` as a child process; this process
              converts the torch batch to a TrainBatch (flywheel.codec) and
              awaits TrainStep over gRPC (TrainerClient, auth off), one call
              at a time. Includes serialisation, the wire, the server's
              thread hop and the response.
  in-process  a TrainingEngine in this process, built from the same config,
              calling `train_step` on the same tensors in a worker thread
              (as the servicer does): the work the service does for a
              TrainStep, minus the RPC.
Both run --warmup steps first, then --steps timed steps each, one side's
step after the other's, so load from anything else on the machine hits both
alike; tokens/s per side is tokens per step over the median step time (the
mean-based ratio is reported too). Tokens are the batch's non-padding tokens.
On a busy machine the two sides' figures move with whatever else runs, so a
paired figure is printed too: for the same service steps, the engine's own
time (the `step_seconds` metric the server returns) over the round trip the
client saw, and the median difference (the RPC's own cost, in ms). Acceptance: service_vs_inprocess (service tokens/s over in-process
tokens/s) >= 0.9, i.e. under 10% service overhead.
Ends with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.launcher.processes import start_service  # noqa: E402
from flywheel.models.tiny import build_tiny_model  # noqa: E402
from flywheel.trainer.client import TrainerClient, make_loss_spec, make_train_batch  # noqa: E402
from services.trainer.config import TrainerConfig  # noqa: E402
from services.trainer.loss_request import LossRequest  # noqa: E402
from services.trainer.training import TrainingEngine  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

LOSS_KIND, IS_CAP = "grpo", 2.0


def make_batch(batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch_size, seq_len), generator=g)
    attention = torch.ones(batch_size, seq_len, dtype=torch.int64)
    for row in range(batch_size):
        attention[row, seq_len - (row * 7) % (seq_len // 4) :] = 0  # ragged right padding
    attention[:, 0] = 1
    prompt = seq_len // 4
    loss_mask = torch.zeros(batch_size, seq_len)
    loss_mask[:, prompt:] = 1.0
    loss_mask *= attention
    return {
        "input_ids": ids * attention,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "advantages": torch.randn(batch_size, generator=g),
        "behaviour_logprobs": (-torch.rand(batch_size, seq_len, generator=g) - 6.0) * loss_mask,
        "weight_versions": torch.zeros(batch_size, dtype=torch.int64),
    }


class ServiceSide:
    """TrainStep through a TrainerClient."""

    def __init__(self, address: str, batch: dict, micro: int) -> None:
        self.client = TrainerClient(address, timeout=600)
        self.batch, self.micro, self.loss = batch, micro, make_loss_spec(LOSS_KIND, is_cap=IS_CAP)

        self.server_seconds: list[float] = []  # the engine's own time per step, as the server reports it

    async def step(self) -> tuple[float, int]:
        started = time.perf_counter()
        message = make_train_batch(**self.batch)  # conversion is part of the service's cost
        result = await self.client.train_step(message, self.loss, micro_batch_size=self.micro)
        took = time.perf_counter() - started
        self.server_seconds.append(result.metrics["step_seconds"])
        return took, result.tokens


class InProcessSide:
    """The engine's train_step, called directly."""

    def __init__(self, engine: TrainingEngine, batch: dict, micro: int) -> None:
        self.engine, self.batch, self.micro = engine, batch, micro
        self.loss = LossRequest(kind=LOSS_KIND, is_cap=IS_CAP)

    async def step(self) -> tuple[float, int]:
        started = time.perf_counter()
        # In a worker thread, as the servicer runs it: glibc gives threads
        # their own malloc arenas, and the main thread's arena returns big
        # freed blocks to the OS eagerly, which alone costs ~10% on CPU.
        result = await asyncio.to_thread(self.engine.train_step, self.batch, self.loss, self.micro)
        return time.perf_counter() - started, result.tokens


async def measure(args: argparse.Namespace, model: Path, run_dir: Path) -> dict:
    cfg = {"model": {"path": str(model), "device": args.device, "cpu_threads": args.threads}, "optimizer": {"lr": args.lr},
           "limits": {"max_batch_tokens": max(262_144, args.batch_size * args.seq_len)}}
    engine = TrainingEngine(TrainerConfig.model_validate(cfg))
    engine.load()
    gc.collect()
    gc.freeze()  # as the service does after loading (services/trainer/app.py)
    batch = make_batch(args.batch_size, args.seq_len, engine.policy.vocab_size)

    flags = ["--model.path", str(model), "--model.device", args.device, "--model.cpu-threads", str(args.threads),
             "--optimizer.lr", str(args.lr),
             "--limits.max-batch-tokens", str(cfg["limits"]["max_batch_tokens"]), "--server.log-level", "WARNING"]
    # A clean environment: no stray FLYWHEEL_ settings, no auth (the client sends no token).
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    child = start_service("trainer", run_dir, flags, env, python=sys.executable)
    try:
        child.wait_ready(300)
        sides = {"service": ServiceSide(child.grpc_address, batch, args.micro_batch_size),
                 "inprocess": InProcessSide(engine, batch, args.micro_batch_size)}
        for _ in range(args.warmup):
            for side in sides.values():
                await side.step()
        sides["service"].server_seconds.clear()
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        tokens: dict[str, int] = dict.fromkeys(sides, 0)
        # Steps alternate (and which side goes first alternates too), so load
        # from anything else on the machine falls on both sides alike.
        order = list(sides)
        for i in range(args.steps):
            for name in order if i % 2 == 0 else order[::-1]:
                took, n = await sides[name].step()
                seconds[name].append(took)
                tokens[name] += n
        await sides["service"].client.close()
    finally:
        child.stop()
    per_step = int(batch["attention_mask"].sum())
    figures = {"parameters": engine.policy.parameter_count, "tokens_per_step": per_step}
    # Paired figure, immune to load from elsewhere: the same steps' engine time
    # (inside the server) over their round-trip time (at the client).
    figures["engine_share_of_rpc"] = sum(sides["service"].server_seconds) / sum(seconds["service"])
    figures["rpc_overhead_ms"] = statistics.median(
        c - e for c, e in zip(seconds["service"], sides["service"].server_seconds)) * 1e3
    for name in sides:
        figures[f"{name}_step_ms"] = statistics.median(seconds[name]) * 1e3
        figures[f"{name}_tokens_per_s"] = per_step / statistics.median(seconds[name])
        figures[f"{name}_mean_tokens_per_s"] = tokens[name] / sum(seconds[name])
    return figures


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", type=Path, help="HF model directory; default: build a tiny Qwen2 in a temp dir")
    parser.add_argument("--layers", type=int, default=4, help="(default 4; smoke 2)")
    parser.add_argument("--hidden", type=int, default=256, help="multiple of 64 (head_dim 64) (default 256; smoke 128)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256, help="(default 256; smoke 64)")
    parser.add_argument("--micro-batch-size", type=int, default=0, help="0: the whole batch in one pass")
    parser.add_argument("--warmup", type=int, default=2, help="(default 2; smoke 1)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side (default 20; smoke 2)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads on both sides (model.cpu_threads); 0: torch's default")
    args = parse_with_smoke(parser, "2 layers, hidden 128, 64 tokens, 2 timed steps: checks the bench runs (CI)",
                            layers=2, hidden=128, seq_len=64, warmup=1, steps=2)
    if args.model is not None and (args.layers, args.hidden) != (parser.get_default("layers"), parser.get_default("hidden")):
        parser.error("--layers and --hidden size the tiny model this bench builds; --model takes yours as it is")

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-trainer-") as tmp:
        model = args.model or build_tiny_model(
            Path(tmp) / "model", num_layers=args.layers, hidden_size=args.hidden, num_heads=args.hidden // 64,
            num_kv_heads=max(1, args.hidden // 128), intermediate_size=args.hidden * 4,
        )
        figures = asyncio.run(measure(args, Path(model), Path(tmp) / "run"))
    gc.unfreeze()  # else extension modules report the frozen objects as leaked at exit

    ratio = figures["service_tokens_per_s"] / figures["inprocess_tokens_per_s"]
    print(f"model: {figures['parameters'] / 1e6:.2f}M parameters on {args.device}; batch {args.batch_size}x{args.seq_len} "
          f"({figures['tokens_per_step']} tokens); median of {args.steps} alternating steps per side; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'path':<28}{'tokens/s':>12}{'ms/step':>10}{'vs in-process':>15}")
    for label, key in (("TrainStep via gRPC service", "service"), ("train_step in-process", "inprocess")):
        rate = figures[f"{key}_tokens_per_s"]
        print(f"{label:<28}{rate:>12.1f}{figures[f'{key}_step_ms']:>10.1f}"
              f"{rate / figures['inprocess_tokens_per_s']:>14.3f}x")
    print(f"RPC overhead per step (round trip minus the engine's own time, same steps): "
          f"{figures['rpc_overhead_ms']:.1f} ms; engine share of the round trip {figures['engine_share_of_rpc']:.3f}")
    record("trainer", {
        "device": args.device,
        "parameters": figures["parameters"],
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens_per_step": figures["tokens_per_step"],
        "steps": args.steps,
        "service_tokens_per_s": round(figures["service_tokens_per_s"], 1),
        "inprocess_tokens_per_s": round(figures["inprocess_tokens_per_s"], 1),
        "service_step_ms": round(figures["service_step_ms"], 2),
        "inprocess_step_ms": round(figures["inprocess_step_ms"], 2),
        "service_vs_inprocess": round(ratio, 4),
        "service_vs_inprocess_mean": round(
            figures["service_mean_tokens_per_s"] / figures["inprocess_mean_tokens_per_s"], 4),
        "service_overhead_pct": round((1 - ratio) * 100, 2),
        "rpc_overhead_ms": round(figures["rpc_overhead_ms"], 2),
        "engine_time_vs_round_trip": round(figures["engine_share_of_rpc"], 4),
    }, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
