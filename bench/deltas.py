"""How much of a version a delta carries: consecutive versions of a real run, in float32 and bfloat16.

Run manual (~5 minutes on 2 cores):
    python bench/deltas.py                      # the quickstart job (SmolLM2-135M, lr 1e-5), 6 steps
    python bench/deltas.py --run-dir runs/quickstart   # the checkpoints of a run already made
    python bench/deltas.py --smoke              # the tiny quickstart, 3 steps (CI)

The versions are the run's own: the first steps of the quickstart, with a checkpoint after every
step (its learning rate and schedule over its 30 steps, data, GRPO steps, mode), and version k is
`checkpoints/global_step_k/model`, version 0 the model the run started from. For each step
k-1 -> k, and for a replica that lags from version 0 to the last, it reports the delta
(flywheel/codec/delta.py) as a fraction of the full version:

  float32   the weights as the CPU quickstart publishes them; weight decay and Adam touch every
            element a step, so nearly all change, in their low bits: what XOR of the shuffled
            bytes plus zstd still saves;
  bfloat16  the same weights cast to bfloat16, as a GPU deployment serves them (its trainer keeps
            float32 masters and publishes bfloat16): most elements round to the value they had.

Baselines measured in the same run: the full version as raw bytes (what a transfer carries
today) and the full version zstd-compressed at the same level (what compression alone gives,
without a base). Ratios: `delta_vs_full_<dtype>` (full bytes over delta bytes, mean over the
steps) and `delta_vs_zstd_full_<dtype>` (zstd of the full version over the delta). Also the
encode and apply-and-verify seconds per version, beside a memcpy of the model. Ends with one
JSON line, with the CPU named.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.testing.machine import cpu  # noqa: E402
from flywheel.testing.records import record  # noqa: E402
from flywheel.testing.run_versions import load, make_run, versions  # noqa: E402


def _bits(tensor):
    """The elements' bit patterns as integers, to count changed elements exactly (NaN included)."""
    import torch

    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def measure(run_dir: Path) -> dict:
    import torch
    import zstandard

    from flywheel.codec.delta import ZSTD_LEVEL, apply_delta, encode_delta
    from flywheel.codec.dtypes import byte_view
    from flywheel.codec.identity import identify

    chain = versions(run_dir)
    if len(chain) < 3:
        raise SystemExit(f"{run_dir}: need at least two checkpoints, found {len(chain) - 1}")
    report: dict = {"versions": [v for v, _ in chain]}
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        states = [load(path, dtype) for _, path in chain]
        full = sum(t.numel() * t.element_size() for t in states[0].values())
        started = time.perf_counter()
        zstd_full = sum(len(compressor.compress(byte_view(t))) for t in states[-1].values())
        zstd_seconds = time.perf_counter() - started
        steps = []
        for (m, base), (n, new) in [*zip(zip(report["versions"], states), zip(report["versions"][1:], states[1:])),
                                    ((report["versions"][0], states[0]), (report["versions"][-1], states[-1]))]:
            started = time.perf_counter()
            delta = encode_delta(base, new)
            encode = time.perf_counter() - started
            target = identify(new)
            started = time.perf_counter()
            apply_delta(base, delta.records, target)
            apply = time.perf_counter() - started
            changed = [int((_bits(new[k]) != _bits(base[k])).sum()) for k in new]
            kinds: dict[str, int] = {}
            for kind in delta.kinds.values():
                kinds[kind.name] = kinds.get(kind.name, 0) + 1
            steps.append({"from": m, "to": n, "delta_fraction": round(delta.fraction, 6),
                          "changed_elements": round(sum(changed) / sum(t.numel() for t in new.values()), 4),
                          "tensors_changed": sum(1 for c in changed if c), "kinds": kinds,
                          "encode_seconds": round(encode, 3), "apply_verify_seconds": round(apply, 3)})
        consecutive = steps[:-1]
        copy = {k: torch.empty_like(t) for k, t in states[-1].items()}
        started = time.perf_counter()
        for k, t in states[-1].items():
            copy[k].copy_(t)
        memcpy = time.perf_counter() - started
        mean_fraction = statistics.mean(s["delta_fraction"] for s in consecutive)
        report[label] = {
            "full_bytes": full, "zstd_full_fraction": round(zstd_full / full, 4),
            "zstd_full_seconds": round(zstd_seconds, 3), "memcpy_seconds": round(memcpy, 4),
            "steps": steps, "mean_step_fraction": round(mean_fraction, 6),
            "delta_vs_full": round(1 / mean_fraction, 2),
            "delta_vs_zstd_full": round(zstd_full / full / mean_fraction, 2),
        }
        del states, copy  # one dtype's copies at a time
    return report


def main() -> None:
    parser = bench_parser(__doc__)
    # One or the other: --steps sizes the run this bench makes, --run-dir takes a finished one.
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--steps", type=int, default=6, help="steps to run (default 6; smoke 3)")
    source.add_argument("--run-dir", type=Path, help="use this run's checkpoints instead of making a run")
    args = parse_with_smoke(parser, "the tiny quickstart, 3 steps (CI)", steps=3)
    with tempfile.TemporaryDirectory(prefix="flywheel-deltas-") as tmp:
        started = time.monotonic()
        run_dir = args.run_dir or make_run(args.smoke, args.steps, Path(tmp))
        run_seconds = time.monotonic() - started
        report = measure(run_dir)
    for label in ("fp32", "bf16"):
        r = report[label]
        print(f"\n{label}: full {r['full_bytes'] / 2**20:.1f} MiB, zstd of the full version "
              f"{r['zstd_full_fraction']:.1%} ({r['zstd_full_seconds']:.2f} s), memcpy {r['memcpy_seconds']:.3f} s")
        print(f"  {'from':>4} {'to':>3} {'delta':>8} {'elements changed':>17} {'encode s':>9} {'apply+verify s':>15}  kinds")
        for s in r["steps"]:
            print(f"  {s['from']:>4} {s['to']:>3} {s['delta_fraction']:>8.2%} {s['changed_elements']:>17.2%} "
                  f"{s['encode_seconds']:>9.2f} {s['apply_verify_seconds']:>15.2f}  {s['kinds']}")
    fp32, bf16 = report["fp32"], report["bf16"]
    record("deltas", {
        **cpu(), "smoke": args.smoke, "versions": report["versions"][-1], "run_seconds": round(run_seconds, 1),
        "full_mib": round(fp32["full_bytes"] / 2**20, 1),
        "delta_fraction_fp32": fp32["mean_step_fraction"], "delta_fraction_bf16": bf16["mean_step_fraction"],
        "zstd_full_fraction_fp32": fp32["zstd_full_fraction"], "zstd_full_fraction_bf16": bf16["zstd_full_fraction"],
        "delta_vs_full_fp32": fp32["delta_vs_full"], "delta_vs_full_bf16": bf16["delta_vs_full"],
        "delta_vs_zstd_full_fp32": fp32["delta_vs_zstd_full"], "delta_vs_zstd_full_bf16": bf16["delta_vs_zstd_full"],
    }, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
