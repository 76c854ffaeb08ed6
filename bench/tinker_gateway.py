"""The Tinker gateway's overhead: forward_backward + optim_step through the official SDK and the
gateway, against the same two calls made on the trainer service directly, on the same batch.

Run manual:
    python bench/tinker_gateway.py                      # tiny Qwen2, LoRA rank 8, 8 datums of 128 tokens
    python bench/tinker_gateway.py --layers 4 --hidden 256 --seq-len 256 --rounds 10
    python bench/tinker_gateway.py --smoke              # seconds: checks it runs (CI)

Measured in the same run, against one trainer process (`python -m services.trainer`, LoRA):
  gateway  `python -m services.tinker` in front of it; this process drives the SDK
           (`tinker==0.38`): training_client.forward_backward(data, "cross_entropy").result(),
           then optim_step(AdamParams).result(). Includes the SDK's protobuf encoding, HTTP,
           the futures protocol (a retrieve_future long poll per call), the gateway's
           conversion to a TrainBatch and its gRPC calls.
  direct   a TrainerClient in this process calling ForwardBackward and OptimStep with the
           TrainBatch of the same datums, built once (what the gateway builds per call).
Rounds alternate between the sides (one gateway round, then one direct), after --warmup
rounds each, so load from anything else hits both alike. gateway_vs_direct is the
median gateway round's time over the median direct round's: the gateway's cost, lower
is better (the issue's goal: 1.1 or less). Ends with one JSON line of the figures.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.launcher.processes import start_service  # noqa: E402
from flywheel.models.tiny import HEAD_DIM, build_tiny_model  # noqa: E402
from flywheel.runtime.http_server import http_ready_file  # noqa: E402
from flywheel.testing.machine import cpu  # noqa: E402
from flywheel.testing.records import commit, record  # noqa: E402
from flywheel.trainer.client import TrainerClient  # noqa: E402
from flywheel.trainer.types import AdamStep  # noqa: E402
from services.tinker.wire import trainer_call  # noqa: E402

LEARNING_RATE = 1e-4
LORA_MODULES = '["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]'


def datums(count: int, length: int, vocab: int) -> list[types.Datum]:
    import random

    rng = random.Random(0)
    out = []
    for _ in range(count):
        tokens = [rng.randrange(3, vocab) for _ in range(length + 1)]
        weights = [0.0] * (length // 4) + [1.0] * (length - length // 4)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    return out


class Loop:
    """An event loop in a thread, for the direct side's async client (the SDK runs its own)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128, help="a multiple of 64")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parse_with_smoke(parser, "tiny sizes, 2 rounds: checks it runs",
                            layers=1, hidden=64, seq_len=32, batch_size=2, rounds=2, warmup=1)

    with tempfile.TemporaryDirectory(prefix="bench-tinker-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", num_layers=args.layers, hidden_size=args.hidden,
                                 num_heads=args.hidden // HEAD_DIM, max_position_embeddings=max(512, 2 * args.seq_len))
        checkpoints = root / "checkpoints"
        trainer = start_service("trainer", root / "run", (
            "--model.path", str(model), "--checkpoint.dir", str(checkpoints), "--model.lora.enabled", "true",
            "--model.lora.rank", str(args.rank), "--model.lora.target-modules", LORA_MODULES))
        gateway = None
        try:
            trainer.wait_ready(300)
            gateway = start_service("tinker", root / "run", (
                "--trainer-address", trainer.grpc_address, "--http-port", "0",
                "--checkpoint-dir", str(checkpoints / "tinker")))
            gateway.wait_ready(300)
            port = json.loads(http_ready_file(gateway.ready_path).read_text())["http_port"]
            data = datums(args.batch_size, args.seq_len, 700)
            adam = types.AdamParams(learning_rate=LEARNING_RATE)

            service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key="tml-bench")
            training = service.create_lora_training_client(
                base_model=str(model), rank=args.rank, train_unembed=False).result()
            loop = Loop()

            async def connect() -> TrainerClient:  # its channel belongs to the loop it is made on
                return TrainerClient(trainer.grpc_address, timeout=600)

            direct = loop.run(connect())
            message = forward_backward_request_to_proto(types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
                model_id="direct", seq_id=1))
            call = trainer_call(message)

            def gateway_round() -> float:
                started = time.perf_counter()
                training.forward_backward(data, "cross_entropy").result()
                training.optim_step(adam).result()
                return time.perf_counter() - started

            async def direct_calls() -> None:
                await direct.forward_backward(call.batch, call.loss)
                # What the gateway sends for the SDK's AdamParams defaults, field by field.
                await direct.optim_step(adam=AdamStep(learning_rate=LEARNING_RATE, beta1=0.9, beta2=0.95, eps=1e-12,
                                                      weight_decay=0.0, max_grad_norm=0.0))

            def direct_round() -> float:
                started = time.perf_counter()
                loop.run(direct_calls())
                return time.perf_counter() - started

            for _ in range(args.warmup):
                gateway_round()
                direct_round()
            gateway_times, direct_times = [], []
            for _ in range(args.rounds):
                gateway_times.append(gateway_round())
                direct_times.append(direct_round())
            service.close("success").result()
            loop.run(direct.close())
        finally:
            for child in (gateway, trainer):
                if child is not None:
                    child.stop()

    gateway_s, direct_s = statistics.median(gateway_times), statistics.median(direct_times)
    ratio = gateway_s / direct_s
    print(f"{args.batch_size} datums x {args.seq_len} tokens, LoRA rank {args.rank}, {args.rounds} rounds "
          f"(+{args.warmup} warm-up) per side")
    print(f"{'path':<44}{'ms/round':>10}")
    print(f"{'SDK -> gateway -> trainer':<44}{gateway_s * 1000:>10.1f}")
    print(f"{'TrainerClient -> trainer (direct)':<44}{direct_s * 1000:>10.1f}")
    print(f"gateway_vs_direct {ratio:.3f} (time: lower is better; goal 1.1 or less)")
    record("tinker_gateway", {
        **cpu(), "commit": commit(), "layers": args.layers, "hidden": args.hidden,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "lora_rank": args.rank, "rounds": args.rounds,
        "gateway_round_ms": round(gateway_s * 1000, 2), "direct_round_ms": round(direct_s * 1000, 2),
        "gateway_vs_direct": round(ratio, 4),
    }, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
