"""Rollout throughput, ours vs vLLM in-process, and the pause a weight update costs.

Run manual:
    python bench/rollout.py                          # tiny model, 64 prompts x 64 tokens, 5 rounds
    python bench/rollout.py --model smollm2 --prompts 32 --max-tokens 64
    python bench/rollout.py --model smollm2 --skip-throughput   # update pause times only
    python bench/rollout.py --smoke                  # one small round: checks it runs (CI)

Measured in the same run, on the same model, prompts (token ids) and sampling
parameters (temperature 1, max_tokens M, ignore_eos, the chosen token's
log-prob); tokens/s counts completion tokens over wall time. The three run
in turn within each round (--warmup untimed rounds, then --reps timed ones), so
they share the machine's load of the moment; figures are medians:
  inprocess  vLLM's own `LLM.generate` in a process of its own: the baseline
             with no server at all.
  grpc       our `Generate` RPC, all prompts in one batch request, against
             `python -m services.rollout` (vLLM engine, same engine args).
  http       our OpenAI `/v1/completions`, one request per prompt, all
             prompts from concurrent clients (aiohttp, which vLLM installs) at once.
Start-up, first (--starts times, alternating, nothing else running): vLLM's
own `LLM(...)` in a process of its own, from the process's start to the engine
ready, against `python -m services.rollout` from its start to its ready file
(the engine up, the gRPC server answering) -> service_start_vs_vllm_llm.
Then weight updates on the idle service: `pause_seconds` (gate closed to
gate open: pause, in-place swap, resume) and the whole call, for CHECKPOINT
(a safetensors directory inside the rollout's `updates.checkpoint_root`) and
MEMORY (pushed beforehand to the rollout's own synchronizer, a real one in a
process of its own started first, and pulled from it as a deployment does:
in place from its shared-memory segments, on this host).
Ends with one JSON line of the figures; ratios are named `<ours>_vs_<baseline>`.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository: its tests' helper writes a version as a trainer does

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

TOKEN = "bench-token"


def engine_args(model: str) -> dict:
    """The same engine arguments for both sides. Stats logging is off, as `LLM`
    has it by default; the service then reports its own request counts."""
    kv = 64 if model == "tiny" else 256
    return dict(dtype="float32", max_model_len=512, max_num_seqs=128, kv_cache_memory_bytes=kv * 2**20,
                enforce_eager=True, seed=0, disable_log_stats=True)


def prepare_model(name: str, work: Path) -> Path:
    if name == "tiny":
        from flywheel.models.tiny import build_tiny_model

        return build_tiny_model(work / "tiny")
    from flywheel.models.smollm2 import convert_smollm2

    return convert_smollm2()


def make_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(f"Question {i}: what is {i * 7 % 91} + {i * 13 % 57}? Think step by step.") for i in range(count)]


# -- (a) vLLM in-process ---------------------------------------------------------


def _inprocess(model_dir: str, args: dict, prompts: list, max_tokens: int, commands: mp.Queue, out: mp.Queue) -> None:
    """Child process: vLLM's LLM, one timed `generate` of every prompt per "run" command."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, **args)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    out.put("ready")
    while commands.get() == "run":
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        out.put(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    llm.llm_engine.engine_core.shutdown()
    out.close()
    out.join_thread()
    os._exit(0)  # skip interpreter teardown: it can stall on vLLM's objects


class InProcess:
    """vLLM's `LLM.generate` in a process of its own, run on demand so its
    repetitions interleave with ours under the same machine load. Constructed,
    it is ready: the constructor returns once the engine is up."""

    def __init__(self, model_dir: Path, args: dict, prompts: list, max_tokens: int) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.child = ctx.Process(target=_inprocess, args=(str(model_dir), args, prompts, max_tokens, self.commands, self.results))
        self.child.start()
        if self.results.get(timeout=1800) != "ready":
            raise RuntimeError("in-process vLLM did not start")

    def run(self) -> float:
        self.commands.put("run")
        return self.results.get(timeout=1800)

    def stop(self) -> None:
        self.commands.put("stop")
        self.child.join(60)
        if self.child.is_alive():
            self.child.kill()
            self.child.join()


def start_seconds(model_dir: Path, args: dict, run_dir: Path, prompts: list, max_tokens: int) -> dict[str, float]:
    """Seconds until vLLM's own LLM is ready in a new process, then until our rollout service is."""
    began = time.perf_counter()
    InProcess(model_dir, args, prompts, max_tokens).stop()  # timed up to its "ready"; the stop is not
    vllm_seconds = time.perf_counter() - began
    began = time.perf_counter()
    child = start_rollout(model_dir, args, run_dir)
    ours = time.perf_counter() - began
    child.stop()
    return {"vllm_llm": vllm_seconds, "service": ours}


# -- (b) gRPC and (c) HTTP against the service ---------------------------------------


class Ours:
    """Clients of the rollout service: one gRPC channel, one aiohttp session
    (httpx spends ~10 ms of client CPU per request here, which on a small
    machine is taken from the engine; aiohttp spends ~0.3 ms)."""

    def __init__(self, address: str, http_port: int, prompts: list, max_tokens: int) -> None:
        self.address, self.http_port, self.prompts, self.max_tokens = address, http_port, prompts, max_tokens

    async def __aenter__(self) -> Ours:
        import aiohttp

        from flywheel.common.v1 import common_pb2
        from flywheel.rollout.v1 import rollout_pb2 as pb
        from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
        from flywheel.runtime.client import open_channel

        sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=self.max_tokens, ignore_eos=True)
        self.request = pb.GenerateRequest(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=p)) for p in self.prompts], sampling=sampling)
        self.channel = open_channel(self.address, token=TOKEN, default_timeout=1800)
        self.stub = pb_grpc.RolloutServiceStub(self.channel)
        self.session = aiohttp.ClientSession(
            f"http://127.0.0.1:{self.http_port}", headers={"Authorization": f"Bearer {TOKEN}"},
            connector=aiohttp.TCPConnector(limit=len(self.prompts)), timeout=aiohttp.ClientTimeout(total=1800))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.channel.close()

    async def grpc(self) -> float:
        start = time.perf_counter()
        response = await self.stub.Generate(self.request)
        elapsed = time.perf_counter() - start
        return sum(len(r.samples[0].completion_token_ids) for r in response.results) / elapsed

    async def http(self) -> float:
        body = dict(max_tokens=self.max_tokens, temperature=1.0, ignore_eos=True)

        async def one(prompt: list[int]) -> int:
            async with self.session.post("/v1/completions", json={**body, "prompt": prompt}) as r:
                r.raise_for_status()
                return len((await r.json())["choices"][0]["token_ids"])

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in self.prompts))
        return sum(tokens) / (time.perf_counter() - start)


# -- weight updates -----------------------------------------------------------------


async def bench_updates(address: str, sync_address: str, model_dir: Path, work: Path, reps: int) -> dict:
    """`work`: the rollout's updates.checkpoint_root; `sync_address`: its synchronizer."""
    from safetensors.torch import load_file

    from tests.unit.rollout.rollout_helpers import probe_of, write_checkpoint

    from flywheel.rollout.v1 import rollout_pb2 as pb
    from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
    from flywheel.runtime.client import open_channel
    from flywheel.synchronizer.client import SynchronizerClient

    base = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        base.update(load_file(str(file)))
    results: dict[str, list[float]] = {"checkpoint_pause": [], "checkpoint_total": [], "memory_pause": [], "memory_total": []}
    async with open_channel(address, token=TOKEN, default_timeout=600) as channel, \
            SynchronizerClient(sync_address, TOKEN, timeout=600, transfer_timeout=600) as sync:
        stub = pb_grpc.RolloutServiceStub(channel)
        version = (await stub.GetStatus(pb.GetStatusRequest())).weight_version
        for _ in range(reps):
            version += 1
            directory = work / f"ckpt-{version}"
            directory.mkdir()
            # As a trainer writes a version: with its manifest and probe, which a replica that cannot read
            # every tensor back (vLLM on CPU) needs to prove the version (else the update is refused, unproven).
            write_checkpoint(directory, {k: v * (1 + 0.01 * version) for k, v in base.items()}, version, model_dir)
            start = time.perf_counter()
            r = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=version, checkpoint=pb.CheckpointSource(path=str(directory))))
            results["checkpoint_total"].append(time.perf_counter() - start)
            results["checkpoint_pause"].append(r.pause_seconds)

            version += 1
            state = {k: v * (1 + 0.01 * version) for k, v in base.items()}
            await sync.push_weights(state, version, probe=probe_of(model_dir, state))
            start = time.perf_counter()
            r = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=version, memory=pb.MemorySource()))
            results["memory_total"].append(time.perf_counter() - start)
            results["memory_pause"].append(r.pause_seconds)
    return {key: statistics.median(values) for key, values in results.items()}


def service_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_AUTH_TOKEN"] = TOKEN
    return env


def start_synchronizer(run_dir: Path):
    """The synchronizer the rollout is configured with (its MEMORY updates come from there)."""
    from flywheel.launcher.processes import start_service

    child = start_service("synchronizer", run_dir, ["--server.log-level", "WARNING"], service_env())
    child.wait_ready(120)
    return child


def start_rollout(model_dir: Path, args: dict, run_dir: Path, max_pending: int = 4096, *,
                  sync_address: str = "", checkpoint_root: Path | None = None):
    """The rollout service on free ports with HTTP on; `max_pending`: its admission limit (samples).
    Weight updates need `sync_address` (its synchronizer: MEMORY) or `checkpoint_root` (where the
    CHECKPOINT directories it loads lie)."""
    from flywheel.launcher.processes import start_service

    updates = ["--synchronizer.address", sync_address] if sync_address else []
    if checkpoint_root is not None:
        updates += ["--updates.checkpoint-root", str(checkpoint_root)]
    child = start_service("rollout", run_dir, [
        "--engine.model-path", str(model_dir), "--engine.kind", "vllm", "--engine.args", json.dumps(args),
        "--http-port", "0", "--limits.max-pending-requests", str(max_pending), "--server.log-level", "WARNING",
        *updates,
    ], service_env())
    child.wait_ready(1800)
    return child


async def http_port_of(address: str) -> int:
    from flywheel.rollout.v1 import rollout_pb2 as pb
    from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
    from flywheel.runtime.client import open_channel

    async with open_channel(address, token=TOKEN) as channel:
        return (await pb_grpc.RolloutServiceStub(channel).GetStatus(pb.GetStatusRequest())).http_port


async def throughput(child, baseline: InProcess, prompts: list, max_tokens: int, reps: int, warmup: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"inprocess": [], "grpc": [], "http": []}
    async with Ours(child.grpc_address, await http_port_of(child.grpc_address), prompts, max_tokens) as ours:
        # Warm-up rounds: kernels for new batch shapes, allocator pools, connections.
        for rep in range(warmup + reps):
            got = {"inprocess": baseline.run(), "grpc": await ours.grpc(), "http": await ours.http()}
            print(f"round {rep}{' (warm-up)' if rep < warmup else ''}: " + ", ".join(f"{k} {v:.0f}" for k, v in got.items())
                  + " tokens/s", file=sys.stderr)
            if rep >= warmup:
                for key, value in got.items():
                    rates[key].append(value)
    return rates


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--skip-throughput", action="store_true", help="only measure weight updates")
    parser.add_argument("--starts", type=int, default=3, help="start-ups timed each side (0: none)")
    opts = parse_with_smoke(parser, "4 prompts x 8 tokens, one round, one start each: checks the bench runs (CI)",
                            prompts=4, max_tokens=8, reps=1, warmup=0, starts=1)

    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-rollout-"))
    model_dir = prepare_model(opts.model, work)
    args = engine_args(opts.model)
    prompts = make_prompts(model_dir, opts.prompts)
    figures: dict = {"model": opts.model, "prompts": opts.prompts, "max_tokens": opts.max_tokens, "reps": opts.reps}
    if opts.starts:
        starts = [start_seconds(model_dir, args, work / "starts", prompts, opts.max_tokens) for _ in range(opts.starts)]
        for key in ("vllm_llm", "service"):
            figures[f"{key}_start_seconds"] = round(statistics.median(s[key] for s in starts), 2)
        figures["service_start_vs_vllm_llm"] = round(figures["service_start_seconds"] / figures["vllm_llm_start_seconds"], 3)
        print(f"start-up: {starts}", file=sys.stderr)
    baseline = None if opts.skip_throughput else InProcess(model_dir, args, prompts, opts.max_tokens)
    child = sync = None
    try:
        sync = start_synchronizer(work / "run")
        child = start_rollout(model_dir, args, work / "run", sync_address=sync.grpc_address, checkpoint_root=work)
        if baseline is not None:
            rates = asyncio.run(throughput(child, baseline, prompts, opts.max_tokens, opts.reps, opts.warmup))
            baseline.stop()
            baseline = None
            for key, values in rates.items():
                figures[f"{key}_tokens_per_s"] = round(statistics.median(values), 1)
            for key in ("grpc", "http"):
                figures[f"{key}_vs_inprocess"] = round(figures[f"{key}_tokens_per_s"] / figures["inprocess_tokens_per_s"], 3)
        updates = asyncio.run(bench_updates(child.grpc_address, sync.grpc_address, model_dir, work, min(opts.reps, 3)))
        for key, value in updates.items():
            figures[f"update_{key}_seconds"] = round(value, 4)
        print(f"weight update (median): {updates}", file=sys.stderr)
    finally:
        if baseline is not None:
            baseline.stop()
        if child is not None:
            child.stop()
        if sync is not None:
            sync.stop()
        shutil.rmtree(work, ignore_errors=True)
    record("rollout", figures, args=opts, smoke=opts.smoke)


if __name__ == "__main__":
    main()
