"""Long generations across weight updates: none aborted, every token attributed to the version that made it.

Run manual:
    python bench/long_generations.py                         # both engines: 64 generations x 384 tokens, 3 updates
    python bench/long_generations.py --engine transformers   # one engine
    python bench/long_generations.py --smoke                 # 8 x 384 tokens, 3 updates, both engines (CI)

For each engine (vLLM, and the transformers engine of the CPU fallback), a real rollout service
(`python -m services.rollout`) on the tiny model streams --generations completions at once over
gRPC (GenerateStream: token-id prompts, temperature 1, ignore_eos, --max-tokens each), while the
bench moves it through --updates CHECKPOINT weight updates that name no pause mode (the rollout's
default, keep), the k-th once k/(updates + 1) of all tokens have arrived: fully-async as a run
drives it (nothing waits for a version; generations go on across every update).

Each version differs from the base model only in the final norm's weight, scaled by
1 + SCALE_STEP x version: the layers before it, and so every key and value the engine keeps, are the
same under every version, while each version's logits are the base ones scaled by its factor. The
version that really produced a token is then the one whose scaled logits give the log-prob the
rollout returned for it (replayed here with transformers, float32). Closing figures:

  aborted_requests           requests the updates aborted (their replies' aborted_request_ids) plus
                             completions that ended "abort"; goal 0
  tokens_with_exact_version  fraction of tokens whose version in the sample's spans has weights that
                             reproduce the token's log-prob (within TOLERANCE nats); goal 1.0. Where
                             one version alone does, that is the only right answer; tokens_ambiguous
                             counts those whose log-prob several versions reproduce
  tokens_before_their_update tokens attributed to a version whose update the bench had not even
                             asked for when the token arrived (the rollout's own record of when an
                             update landed, its UpdateWeights reply, against the stream); goal 0
  staleness_histogram        age -> tokens: the newest version minus each token's version, as a
                             trainer on the newest weights would see them
  exact_vs_start_attribution tokens_with_exact_version over the fraction a per-sample record (every
                             token on the version its sample started with) gets right (counting only
                             tokens one version alone reproduces)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from bench.rollout import TOKEN, engine_args, prepare_model, service_env  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

#: Version v's final norm weight is the base one times 1 + SCALE_STEP * v.
SCALE_STEP = 0.5
NORM = "model.norm.weight"
#: Largest |log-prob difference| (nats) between the engine's and the replay's that still counts as the same weights.
TOLERANCE = 1e-3


def write_versions(model_dir: Path, root: Path, count: int) -> dict[int, Path]:
    """CHECKPOINT directories of versions 1..count under `root` (the rollout's updates.checkpoint_root), as a
    trainer writes them: the safetensors and the weight manifest with the trainer's probe of the version (what
    an engine that cannot read its weights back, vLLM on CPU, proves the version by)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from flywheel.codec import build_manifest
    from flywheel.probe import ProbeBatch, probe_sequences
    from services.rollout.weights.verify import MANIFEST_FILE
    from services.trainer.probe import probe_logprobs

    base: dict = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        base.update(load_file(str(file)))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = probe_sequences(model.get_input_embeddings().weight.shape[0])
    out = {}
    for version in range(1, count + 1):
        directory = root / f"v{version}"
        directory.mkdir(parents=True)
        tensors = dict(base)
        tensors[NORM] = base[NORM] * (1 + SCALE_STEP * version)
        save_file(tensors, str(directory / "model.safetensors"))
        model.load_state_dict(tensors, strict=False)
        manifest = build_manifest(tensors, version)
        manifest.probe.CopyFrom(ProbeBatch.of(ids, probe_logprobs(model, ids, torch.device("cpu"))).to_pb())
        (directory / MANIFEST_FILE).write_bytes(manifest.SerializeToString())
        out[version] = directory
    return out


def start_rollout(kind: str, model_dir: Path, run_dir: Path, checkpoint_root: Path):
    from flywheel.launcher.processes import start_service

    args = ["--engine.model-path", str(model_dir), "--engine.kind", kind, "--updates.checkpoint-root",
            str(checkpoint_root), "--limits.max-pending-requests", "4096", "--server.log-level", "WARNING"]
    if kind == "vllm":
        args += ["--engine.args", json.dumps({**engine_args("tiny"), "max_model_len": 1024})]
    else:
        # Room beside the generations for each update's probe, which the transformers engine admits like a
        # request: at its default (64) it would wait for them all to end, holding back what they deliver.
        args += ["--engine.args", json.dumps({"max_num_seqs": 128})]
    child = start_service("rollout", run_dir, args, service_env())
    child.wait_ready(1800)
    return child


async def generate_across_updates(address: str, prompts: list[list[int]], max_tokens: int,
                                  versions: dict[int, Path]) -> dict:
    """Streams every prompt's completion while the updates go in; returns the finals, the arrival of each
    token (the number of updates asked for by then) and the updates' replies."""
    from flywheel.common.v1 import common_pb2
    from flywheel.rollout.v1 import rollout_pb2 as pb
    from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
    from flywheel.runtime.client import open_channel

    total = len(prompts) * max_tokens
    received = 0
    asked = 0  # updates asked for so far
    due = asyncio.Event()

    def due_at(k: int) -> float:
        """The tokens received by the time the k-th update is due: k/(updates + 1) of them all."""
        return k * total / (len(versions) + 1)

    # No per-request seed: vLLM 0.32 on CPU crashes its engine when a seeded request is frozen by a keep pause
    # ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync).
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    async with open_channel(address, token=TOKEN, default_timeout=1800) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)

        async def one(i: int, ids: list[int]) -> tuple[object, list[int]]:
            nonlocal received
            arrivals: list[int] = []
            final = None
            request = pb.GenerateStreamRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids), request_id=f"long-{i}"),
                                               sampling=sampling)
            async for chunk in stub.GenerateStream(request):
                arrivals += [asked] * len(chunk.token_ids)
                received += len(chunk.token_ids)
                if asked < len(versions) and received >= due_at(asked + 1):
                    due.set()
                if chunk.HasField("final"):
                    final = chunk.final
            return final, arrivals

        async def updates() -> list:
            nonlocal asked
            replies = []
            for version, path in sorted(versions.items()):
                await due.wait()
                due.clear()
                asked += 1
                started = time.perf_counter()
                print(f"update to version {version} asked at {received} of {total} tokens", file=sys.stderr)
                reply = await stub.UpdateWeights(pb.UpdateWeightsRequest(
                    version=version, checkpoint=pb.CheckpointSource(path=str(path))))
                print(f"update to version {version}: {time.perf_counter() - started:.2f} s, paused "
                      f"{reply.pause_seconds:.3f} s, aborted {len(reply.aborted_request_ids)}", file=sys.stderr)
                replies.append(reply)
            return replies

        updater = asyncio.create_task(updates())
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        reasons = Counter(final.finish_reason if final is not None else -1 for final, _ in results)
        print(f"generations done ({received} tokens; finish reasons {dict(reasons)})", file=sys.stderr)
        if asked < len(versions):  # the generations ended before every update was asked: the bench is mis-sized
            updater.cancel()
            due_count = sum(received >= due_at(k) for k in range(1, len(versions) + 1))
            raise SystemExit(f"only {asked} of {len(versions)} updates were asked during the generations "
                             f"({due_count} were due: an update still going holds back the next)")
        replies = await updater
    return {"results": results, "replies": replies}


def replay_distances(prompt: list[int], completion: list[int], logprobs: list[float], versions: int, model):
    """|returned log-prob - replayed log-prob under version v| per completion token and version, [tokens, versions + 1]."""
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # position i predicts token i + 1
    target = torch.tensor(completion)[:, None]
    returned = torch.tensor(logprobs)
    return torch.stack([
        (torch.log_softmax(logits * (1 + SCALE_STEP * v), dim=-1).gather(-1, target)[:, 0] - returned).abs()
        for v in range(versions + 1)
    ], dim=-1)


def judge(model_dir: Path, prompts: list[list[int]], run: dict, versions: int) -> dict:
    """A token's version is exact when its version's weights reproduce its log-prob (within TOLERANCE): where one
    version alone does (most tokens), that one; where several do (a token whose log-prob barely moves with the
    logits' scale: `tokens_ambiguous`), one of them."""
    from transformers import AutoModelForCausalLM

    from flywheel.common.provenance import VersionSpan, versions_of

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    exact = start_right = tokens = early = ambiguous = 0
    histogram: Counter[int] = Counter()
    aborted = sum(len(r.aborted_request_ids) for r in run["replies"])
    for prompt, (final, arrivals) in zip(prompts, run["results"]):
        if final is None or final.finish_reason == 3:  # FINISH_REASON_ABORT
            aborted += 1
            continue
        completion = list(final.completion_token_ids)
        spans = [VersionSpan(s.version, s.start, s.end) for s in final.weight_version_spans]
        stamped = versions_of(spans, len(completion))
        distances = replay_distances(prompt, completion, list(final.completion_logprobs), versions, model)
        for i, (version, arrived_after) in enumerate(zip(stamped, arrivals)):
            matching = distances[i] <= TOLERANCE
            tokens += 1
            exact += bool(matching[version])
            ambiguous += int(matching.sum()) > 1
            start_right += bool(matching[final.weight_version_start]) and int(matching.sum()) == 1
            early += version > arrived_after  # its update was not even asked for when it arrived
            histogram[versions - version] += 1
    exact_fraction = exact / max(tokens, 1)
    start_fraction = start_right / max(tokens, 1)
    return {
        "aborted_requests": aborted,
        "tokens": tokens,
        "tokens_with_exact_version": round(exact_fraction, 6),
        "tokens_ambiguous": ambiguous,
        "tokens_before_their_update": early,
        "staleness_histogram": {str(age): n for age, n in sorted(histogram.items())},
        "mixed_version_samples": sum(len(final.weight_version_spans) > 1 for final, _ in run["results"] if final),
        "tokens_right_by_sample_start": round(start_fraction, 6),
        "exact_vs_start_attribution": round(exact_fraction / max(start_fraction, 1e-9), 3),
    }


def bench_engine(kind: str, model_dir: Path, work: Path, prompts: list[list[int]], opts: argparse.Namespace) -> dict:
    root = work / kind / "checkpoints"
    versions = write_versions(model_dir, root, opts.updates)
    child = start_rollout(kind, model_dir, work / kind / "run", root)
    try:
        started = time.perf_counter()
        run = asyncio.run(generate_across_updates(child.grpc_address, prompts, opts.max_tokens, versions))
        seconds = time.perf_counter() - started
    finally:
        child.stop()
    figures = judge(model_dir, prompts, run, opts.updates)
    figures["updates"] = len(run["replies"])
    figures["update_pause_seconds_max"] = round(max(r.pause_seconds for r in run["replies"]), 4)
    figures["seconds"] = round(seconds, 2)
    print(f"{kind}: {figures}", file=sys.stderr)
    return figures


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--engine", choices=["vllm", "transformers", "both"], default="both")
    parser.add_argument("--generations", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--updates", type=int, default=3)
    # The smoke keeps the full length: at 128 tokens, an update slowed by a loaded machine (the suite
    # under a CPU quota) was once still going when the generations ended, and the next was never asked.
    opts = parse_with_smoke(parser, "8 generations x 384 tokens: checks the bench runs (CI)",
                            generations=8, max_tokens=384)

    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-long-"))
    try:
        model_dir = prepare_model("tiny", work)
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok.encode(f"Story {i}: once upon a time, {i * 7 % 13} travellers") for i in range(opts.generations)]
        kinds = ["vllm", "transformers"] if opts.engine == "both" else [opts.engine]
        figures: dict = {"generations": opts.generations, "max_tokens": opts.max_tokens, "updates": opts.updates}
        for kind in kinds:
            figures[kind] = bench_engine(kind, model_dir, work, prompts, opts)
        # The headline figures: the worst over the engines.
        figures["aborted_requests"] = sum(figures[k]["aborted_requests"] for k in kinds)
        figures["tokens_with_exact_version"] = min(figures[k]["tokens_with_exact_version"] for k in kinds)
        figures["tokens_before_their_update"] = sum(figures[k]["tokens_before_their_update"] for k in kinds)
        figures["exact_vs_start_attribution"] = min(figures[k]["exact_vs_start_attribution"] for k in kinds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record("long_generations", figures, args=opts, smoke=opts.smoke)


if __name__ == "__main__":
    main()
