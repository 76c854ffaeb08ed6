"""What one fleet update costs a rollout replica, phase by phase, with real services.

Run manual:
    python bench/fleet_update.py              # the tiny model, then the 0.5B-shaped one; 3 updates each
    python bench/fleet_update.py --smoke      # the tiny model only, 2 updates (what CI runs)
    python bench/fleet_update.py --shapes 0.5b --reps 5 --no-pin
    python bench/fleet_update.py --engine vllm   # the same on vLLM (CPU), the quickstart's engine

What runs, per model shape, from scratch: a real synchronizer, trainer and
rollout (the transformers engine, or vLLM with --engine vllm) as separate processes, the trainer and the
rollout pinned to one core each (`taskset`; --no-pin to share), the
synchronizer on the rollout's core. The synchronizer's policy is FIXED(1, 0),
MEMORY, fully-async (a generation waits for nothing), pause mode keep. A
client keeps the replica busy with small generations throughout, so every
update finds requests in flight. Each round: the trainer takes one real
optimizer step (it publishes the new version before the step answers), a
generation of the next run step makes the replica follow it, and the
replica's report of that update (ReportUpdate, read back with ListUpdates)
gives its phases: transfer (the bytes pulled from the synchronizer's shared
memory and verified, generation going on), admit (the engine reaching its
step boundary, where in-flight requests freeze: generation still runs, and
requests arriving meanwhile queue as at any step), apply (the tensors
loaded), verify (the identity of the resident weights measured and compared
with the version's: RESIDENT digests read back, RECEIVED ones hashed by the
loader, the probe scored), reopen, and pause (the engine frozen to reopen:
what generation feels). Every update must verify with full coverage; the
JSON says how it was covered.

Shapes: `tiny` is the quickstart-tiny model (float32); `0.5b` is the
Qwen2.5-0.5B body (24 layers, hidden 896, 14 query and 2 key-value heads of
64, MLP 4864) in bfloat16 with the local tokenizer's small vocabulary, so
~360M parameters (the real one's 136M embedding parameters are left out).

vLLM loads each version into a copy of the model's weights before the pause
(`updates.prepare_outside_pause`, on by default on the CPU; docs/verification.md): `prepare` is that part of
the transfer phase, and the bytes' own transfer is what remains of it.

The baseline, measured in the same rounds: the pause a replica would impose
if it stopped generating for the whole update (stop the world: transfer plus
our pause). Ends with one JSON line: per shape the median seconds of every
phase, `pause_vs_transfer` (our pause over the bytes' transfer, prepare not
counted; the goal is <= 0.5 on the 0.5B shape) and `pause_vs_stop_the_world`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.launcher.processes import ServiceProcess, start_service  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

PHASES = ("transfer", "prepare", "admit", "apply", "verify", "reopen", "pause")
#: The Qwen2.5-0.5B body, as flywheel.models.tiny builds it (head_dim 64).
SHAPE_05B = dict(num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                 max_position_embeddings=2048, dtype="bfloat16")


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__)
    ap.add_argument("--shapes", default="tiny,0.5b", help="comma-separated: tiny, 0.5b (default tiny,0.5b; smoke tiny)")
    ap.add_argument("--reps", type=int, default=3,
                    help="measured updates per shape, after one warm-up (default 3; smoke 2)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the trainer and the rollout to cores")
    ap.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                    help="the rollout's inference engine")
    return parse_with_smoke(ap, "the tiny shape only, 2 updates: a quick check (CI)", shapes="tiny", reps=2)


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pinned(core: int | None, work: Path) -> str:
    """A Python that runs on `core` only (start_service takes an interpreter)."""
    if core is None or shutil.which("taskset") is None:
        return sys.executable
    wrapper = work / f"python-core{core}"
    wrapper.write_text(f'#!/bin/sh\nexec taskset -c {core} {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def start(kind: str, work: Path, config: dict, python: str) -> ServiceProcess:
    directory = work / kind
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return start_service(kind, directory, ["--config", str(directory / "config.yaml")], python=python)


def build_model(shape: str, work: Path) -> tuple[Path, str]:
    """(model directory, its dtype)."""
    if shape == "tiny":
        from services.controller.launcher.prepare import prepare_model
        from services.controller.launcher.spec import ModelSource

        quick = yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())
        spec = {**quick["launch"]["model"], "dtype": "float32"}
        return prepare_model(ModelSource(**spec)), "float32"
    from flywheel.models.tiny import build_tiny_model

    return build_tiny_model(work / "model-0.5b", **SHAPE_05B), "bfloat16"


def engine_config(engine: str, model: Path, dtype: str) -> dict:
    args: dict = {"dtype": dtype, "max_model_len": 256, "seed": 0}
    if engine == "vllm":
        args.update(max_num_seqs=16, kv_cache_memory_bytes=256 * 2**20, enforce_eager=True)
    return {"kind": engine, "model_path": str(model), "args": args}


async def measure(shape: str, reps: int, work: Path, pin: bool, engine: str) -> dict:
    from flywheel.rollout.client import RolloutClient
    from flywheel.synchronizer.client import SynchronizerClient
    from flywheel.trainer.client import TrainerClient, make_loss_spec, make_train_batch
    import torch

    model, dtype = build_model(shape, work)
    trainer_core, rollout_core = (cores()[0], cores()[-1]) if pin and len(cores()) > 1 else (None, None)
    children: list[ServiceProcess] = []
    try:
        sync = start("synchronizer", work, {"keep_versions": 2}, pinned(rollout_core, work))
        children.append(sync)
        sync.wait_ready(60)
        trainer = start("trainer", work, {
            "model": {"path": str(model), "cpu_threads": 1, "dtype": dtype},
            "optimizer": {"lr": 1e-5},
            "checkpoint": {"dir": str(work / "checkpoints")},
            "sync": {"synchronizer_address": sync.grpc_address},
        }, pinned(trainer_core, work))
        rollout = start("rollout", work, {
            "http_port": 0,
            "engine": engine_config(engine, model, dtype),
            "synchronizer": {"address": sync.grpc_address, "component_id": "rollout-0"},
        }, pinned(rollout_core, work))
        children += [trainer, rollout]
        trainer.wait_ready(900)
        rollout.wait_ready(900)
        async with SynchronizerClient(sync.grpc_address) as s, TrainerClient(trainer.grpc_address, timeout=900) as t, \
                RolloutClient(rollout.grpc_address, timeout=600) as r:
            await s.configure_policy("fixed", "memory", 1, 0, 600, rollout_wait="none", pause_mode="keep")
            step = {"run": 1}
            stop = asyncio.Event()

            async def load() -> None:
                while not stop.is_set():
                    await r.generate([[1, 2, 3, 4]], max_tokens=16, temperature=1.0, run_step=step["run"])

            background = [asyncio.ensure_future(load()) for _ in range(2)]
            rows: list[dict] = []
            g = torch.Generator().manual_seed(0)
            try:
                for rep in range(reps + 1):
                    ids = torch.randint(3, 200, (2, 32), generator=g)
                    mask = torch.zeros(2, 32)
                    mask[:, 16:] = 1.0
                    batch = make_train_batch(input_ids=ids, attention_mask=torch.ones(2, 32, dtype=torch.int64),
                                             loss_mask=mask, advantages=torch.tensor([1.0, -1.0]),
                                             behaviour_logprobs=torch.full((2, 32), -5.0) * mask)
                    started = time.perf_counter()
                    result = await t.train_step(batch, make_loss_spec("grpo"), expected_step=rep)
                    trained = time.perf_counter() - started
                    version = result.weight_version
                    step["run"] = version + 1  # the replica's next step is a sync point
                    await r.generate([[5, 6, 7]], max_tokens=4, run_step=version + 1)
                    record = None
                    deadline = time.monotonic() + 600
                    while record is None and time.monotonic() < deadline:
                        done = [u for u in await s.list_updates(version) if u.component_id == "rollout-0"]
                        record = done[-1] if done else None
                        await asyncio.sleep(0.05)
                    if record is None or not record.verified:
                        raise SystemExit(f"{shape}: the update to version {version} did not verify: {record}")
                    timings = {p: getattr(record.timings, f"{p}_seconds") for p in PHASES}
                    if rep > 0:  # the first is the warm-up
                        rows.append({**timings, "train_step": trained, "coverage": record.coverage})
                    print(f"  {shape} version {version}: " + ", ".join(f"{p} {v * 1000:.1f} ms" for p, v in timings.items())
                          + f"; {record.coverage.describe()}")
            finally:
                stop.set()
                await asyncio.gather(*background, return_exceptions=True)
            info = await t.get_info()
        medians = {p: statistics.median(row[p] for row in rows) for p in (*PHASES, "train_step")}
        medians["parameters"] = info.parameter_count
        last = rows[-1]["coverage"]
        medians["coverage"] = {"tensors": last.tensors, "resident_tensors": last.resident_tensors,
                               "received_tensors": last.received_tensors, "methods": last.methods,
                               "probe_max_abs_diff": last.probe.max_abs_diff if last.probe.ran else None}
        return medians
    finally:
        for child in reversed(children):
            child.stop(grace=10)


def main() -> None:
    args = parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    pin = not args.no_pin
    print(f"{args.engine} engine; shapes {shapes}; {args.reps} updates each; cores {cores()}; "
          f"{'trainer and rollout pinned to one core each' if pin else 'shared cores'}")
    results: dict[str, dict] = {}
    for shape in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            results[shape] = asyncio.run(measure(shape, args.reps, Path(tmp), pin, args.engine))
    print(f"{'shape':<6} {'params':>8} " + " ".join(f"{p + ' ms':>12}" for p in PHASES))
    for shape, m in results.items():
        print(f"{shape:<6} {m['parameters'] / 1e6:>7.1f}M " + " ".join(f"{m[p] * 1000:>12.1f}" for p in PHASES))
    out: dict[str, object] = {"bench": "fleet_update", "engine": args.engine, "reps": args.reps, "pinned": pin}
    for shape, m in results.items():
        key = shape.replace(".", "_")
        out.update({f"{key}_{p}_seconds": round(m[p], 5) for p in PHASES})
        out[f"{key}_coverage"] = m["coverage"]
        out[f"{key}_pause_vs_transfer"] = round(m["pause"] / max(m["transfer"] - m["prepare"], 1e-9), 3)
        out[f"{key}_pause_vs_stop_the_world"] = round(m["pause"] / max(m["transfer"] + m["pause"], 1e-9), 3)
    main_shape = "0_5b" if "0.5b" in results else shapes[0].replace(".", "_")
    out["pause_vs_transfer"] = out[f"{main_shape}_pause_vs_transfer"]
    record("fleet_update", out, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
