"""The sharded trainer on a GPU, each figure beside a plain-torch baseline from the same run.

Run manual:
    python bench/gpu.py                       # Qwen2-0.5B architecture, random weights, cuda:0
    python bench/gpu.py --steps 10 --batch-size 8 --seq-len 512
    python bench/gpu.py --only ipc            # the ipc handoff figure alone
    python bench/gpu.py --smoke               # (or --cpu-smoke) no GPU: a tiny model on CPU (gloo), to check the script runs

Without CUDA (and without --cpu-smoke) it says so and exits 0: there is
nothing to measure.

The model: the Qwen2.5-0.5B architecture (24 layers, hidden 896, 14 heads,
2 KV heads, MLP 4864, vocabulary 151936, tied embeddings; 494M parameters)
with random weights built here from its config (no hub download), saved
once into a temporary directory that both sides load. Parameters float32,
forward matmuls under bfloat16 autocast on both sides.

Measured in the same run, on the same model directory and the same batch:
  trainer step   TrainingEngine.train_step with parallel.shard (one rank,
                 FSDP2 over nccl, one FSDP unit per decoder layer + the
                 root): validation, the loss-mask-only output head, the
                 DAPO loss, backward, clipping, AdamW, the step counters.
  unsharded      the same TrainingEngine.train_step without parallel.shard
  trainer step   (the default at world_size 1: the model as loaded, no FSDP
                 wrapping): what separates FSDP2's cost from our loss path's.
  compiled       the unsharded trainer step with model.compile (each decoder
  trainer step   layer's forward compiled by inductor); its first step, which
                 compiles, timed apart. CUDA only: on a CPU (--smoke) the
                 compilation alone takes minutes.
  plain step     the same model loaded with from_pretrained onto the GPU,
                 unsharded: full logits, log-softmax, the policy-gradient
                 term -mean(logp * advantage) over the loss mask, backward,
                 clip_grad_norm_, AdamW (fused on CUDA, as the trainer; the
                 per-parameter loop on CPU). The floor a training step cannot beat by much.
  export buckets gather_buckets over the sharded model (one parameter at a
                 time gathered, copied to the host into 512 MiB buckets):
                 what every weight export of a sharded trainer does first.
  d2h copy       `.to("cpu", copy=True)` of every exported tensor of the
                 plain model: the same bytes, device to host, nothing else
                 (on CPU, --cpu-smoke, a memcpy: no figure to read there).
  rollout        the rollout service (`python -m services.rollout`, the
  generate       transformers engine on the device, bfloat16) started as
                 its own process; one Generate RPC over gRPC with
                 --prompts prompts, greedy, --gen-tokens tokens each
                 (ignore_eos), timed at the client. The engine decodes
                 each sequence with its own KV cache, one token per step.
  in-process     the same checkpoint loaded in this process, bfloat16 on
  generate       the same device; `model.generate` of the same prompts,
                 one after another (batch 1, greedy, a KV cache), the
                 same number of tokens. The model for these two: the
                 Qwen2.5-0.5B body (24 layers, hidden 896, 14/2 heads,
                 MLP 4864) with the local tokenizer's vocabulary
                 (`flywheel.models.tiny`: the service needs tokenizer
                 files, and the hub is not reachable).
  ipc handoff    a co-located trainer (a child process on the same GPU)
                 hands the 0.5B model's parameters (bfloat16) to this
                 process through a transfer group with backend ipc
                 (`flywheel.transfer.broadcast`: rendezvous, buckets
                 packed into one shared device buffer, each copied out
                 into the receiver's staging memory), timed at the
                 receiver from joining the group to holding the version.
  d2d copy       `copy_` of the same tensors into preallocated tensors in
                 this process: the same bytes, device to device, once.
                 (No --cpu-smoke figure: ipc needs CUDA.)
Each side runs --warmup rounds first, then --steps timed rounds; the sides
alternate round by round so anything else on the machine hits both alike;
figures are medians. Ratios are throughput ratios, ours over the baseline
(baseline seconds / our seconds: 1.0 is parity, above 1 is faster):
  fsdp_step_vs_plain_step, trainer_step_vs_plain_step (unsharded),
  compiled_step_vs_plain_step,
  export_buckets_vs_d2h_copy,
  rollout_generate_vs_inprocess_generate, ipc_handoff_vs_d2d_copy.
Also printed: the GPU memory peaks of both steps and the export's GPU peak
above the resident model (about one parameter: no second copy).
Ends with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

QWEN2_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True,
)


def build_model(out: Path, shape: dict, seed: int = 0) -> Path:
    """A random-weight Qwen2 causal LM written as an HF directory (float32)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(**shape, torch_dtype="float32")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def make_batch(batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch_size, seq_len), generator=g)
    attention = torch.ones(batch_size, seq_len, dtype=torch.int64)
    loss_mask = torch.zeros(batch_size, seq_len)
    loss_mask[:, seq_len // 4:] = 1.0  # a quarter prompt, the rest completion
    return {
        "input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
        "advantages": torch.linspace(-1.0, 1.0, batch_size),
        "behaviour_logprobs": (-torch.rand(batch_size, seq_len, generator=g) - 10.0) * loss_mask,
    }


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PlainStep:
    """The baseline: the unsharded model, a textbook policy-gradient step."""

    def __init__(self, path: Path, device: str, lr: float, autocast: torch.dtype | None) -> None:
        from transformers import AutoModelForCausalLM

        self.device, self.autocast = device, autocast
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
        self.model.config.use_cache = False
        self.model.train()
        # On CUDA the fused AdamW a torch user would pick; on CPU the per-parameter loop, as the trainer.
        cuda = device.startswith("cuda")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=cuda, foreach=False)

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        ids = batch["input_ids"].to(self.device)
        mask = batch["loss_mask"].to(self.device)[:, 1:]
        adv = batch["advantages"].to(self.device)[:, None]
        with torch.autocast(ids.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            logits = self.model(input_ids=ids, attention_mask=batch["attention_mask"].to(self.device)).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * adv * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def d2h(self) -> int:
        from services.trainer.tied import drop_tied

        state = drop_tied(self.model, {k: v.detach() for k, v in self.model.state_dict().items()})
        host = [t.to("cpu", copy=True) for t in state.values()]
        return sum(t.numel() * t.element_size() for t in host)


def timed(fn, device: str) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def profile_steps(steps: dict, device: str) -> None:
    """torch.profiler's view of one step of each trainer: where the time over the plain step goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sort = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    for name, step in steps.items():
        with profile(activities=activities) as prof:
            step()
            sync(device)
        print(f"--- profile: {name} trainer step, top operators by {sort} ---")
        print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))


def generation_figures(tmp: Path, device: str, smoke: bool, args: argparse.Namespace) -> dict:
    """Tokens per second through the rollout service vs in-process generate (see the module doc)."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from flywheel.launcher.processes import start_service
    from flywheel.models.tiny import build_tiny_model
    from flywheel.common.v1 import common_pb2
    from flywheel.rollout.v1 import rollout_pb2 as pb
    from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
    from flywheel.runtime.client import open_channel

    body = dict(num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256) if smoke else \
        dict(num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             max_position_embeddings=32768)
    path = build_tiny_model(tmp / "generation-model", **body)
    dtype = "float32" if smoke else "bfloat16"
    config = tmp / "rollout.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "http_port": 0,
        "engine": {"kind": "transformers", "model_path": str(path),
                   "args": {"device": device, "dtype": dtype, "max_num_seqs": args.prompts, "seed": 0}},
    }))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device).eval()
    g = torch.Generator().manual_seed(1)
    vocab = int(model.config.vocab_size)
    prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    tokens = args.prompts * args.gen_tokens

    def in_process() -> None:
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=device)
                out = model.generate(ids, max_new_tokens=args.gen_tokens, min_new_tokens=args.gen_tokens,
                                     do_sample=False, use_cache=True, pad_token_id=0)
                assert out.shape[1] == len(prompt) + args.gen_tokens

    service = start_service("rollout", tmp / "rollout-run", ["--config", str(config)])
    try:
        service.wait_ready(600)
        request = pb.GenerateRequest(
            prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=p)) for p in prompts],
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True),
        )

        async def through_service(rounds: int) -> list[float]:
            times = []
            async with open_channel(service.grpc_address, default_timeout=600) as channel:
                stub = pb_grpc.RolloutServiceStub(channel)
                for _ in range(rounds):
                    started = time.perf_counter()
                    response = await stub.Generate(request, timeout=600)
                    times.append(time.perf_counter() - started)
                    assert sum(len(s.completion_token_ids) for r in response.results for s in r.samples) == tokens
            return times

        ours, base = [], []
        for i in range(args.warmup + args.steps):
            [t_ours] = asyncio.run(through_service(1))
            t_base = timed(in_process, device)
            if i >= args.warmup:
                ours.append(t_ours)
                base.append(t_base)
    finally:
        service.stop()
    gen_ours, gen_base = statistics.median(ours), statistics.median(base)
    print(f"{'generate (s)':22}{gen_ours:>14.4f}{gen_base:>14.4f}{gen_base / gen_ours:>8.2f}   "
          f"rollout service (gRPC, transformers engine) vs in-process generate, {args.prompts} prompts x "
          f"{args.gen_tokens} tokens; {tokens / gen_ours:,.0f} vs {tokens / gen_base:,.0f} tokens/s")
    return {
        "generated_tokens": tokens, "rollout_generate_seconds": gen_ours, "inprocess_generate_seconds": gen_base,
        "rollout_generate_vs_inprocess_generate": gen_base / gen_ours,
    }


def _ipc_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the Qwen2.5-0.5B architecture (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_05B))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}  # the tied head once


def _ipc_trainer(ports, bucket_bytes: int) -> None:
    """The co-located trainer: sends its parameters in every group whose port it is handed (None: stop)."""
    from flywheel.transfer.broadcast import GroupSpec, send

    tensors = {n: torch.randn(shape, device="cuda:0").to(torch.bfloat16) for n, shape in _ipc_shapes().items()}
    while (port := ports.get()) is not None:
        send(GroupSpec(f"bench{port}", f"127.0.0.1:{port}", 2, 0, "ipc", time.time() + 120, 1), tensors,
             bucket_bytes=bucket_bytes)


def ipc_figures(args: argparse.Namespace) -> dict:
    """A co-located trainer's handoff through CUDA IPC vs a device-to-device copy (see the module doc)."""
    import multiprocessing
    import socket
    from types import SimpleNamespace

    from flywheel.transfer.broadcast import GroupSpec, placeholders, receive

    shapes = _ipc_shapes()
    like = placeholders({n: SimpleNamespace(dtype=torch.bfloat16, shape=s) for n, s in shapes.items()},
                        torch.device("cuda:0"))
    source = {n: torch.randn(s, device="cuda:0").to(torch.bfloat16) for n, s in shapes.items()}
    target = {n: torch.empty_like(t) for n, t in source.items()}
    nbytes = sum(t.nbytes for t in source.values())
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    trainer = context.Process(target=_ipc_trainer, args=(ports, args.bucket_mib << 20), daemon=True)
    trainer.start()

    def handoff() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ports.put(port)
        staged = receive(GroupSpec(f"bench{port}", f"127.0.0.1:{port}", 2, 1, "ipc", time.time() + 120, 1), like)
        assert sum(t.nbytes for t in staged.values()) == nbytes

    def d2d() -> None:
        for name, tensor in source.items():
            target[name].copy_(tensor)

    ours, base = [], []
    try:
        for i in range(args.warmup + args.steps):
            t_ours = timed(handoff, "cuda:0")
            t_base = timed(d2d, "cuda:0")
            if i >= args.warmup:
                ours.append(t_ours)
                base.append(t_base)
    finally:
        ports.put(None)
        trainer.join(60)
    ipc_ours, ipc_base = statistics.median(ours), statistics.median(base)
    gib = nbytes / 2**30
    print(f"{'ipc handoff (s)':22}{ipc_ours:>14.4f}{ipc_base:>14.4f}{ipc_base / ipc_ours:>8.2f}   "
          f"co-located trainer -> this process through CUDA IPC vs a d2d copy of the same {gib:.2f} GiB; "
          f"{gib / ipc_ours:.1f} vs {gib / ipc_base:.1f} GiB/s")
    return {"ipc_bytes": nbytes, "ipc_handoff_seconds": ipc_ours, "d2d_copy_seconds": ipc_base,
            "ipc_handoff_vs_d2d_copy": ipc_base / ipc_ours}


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="(default 8; smoke 4)")
    parser.add_argument("--seq-len", type=int, default=512, help="(default 512; smoke 64)")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=8,
                        help="prompts per Generate, the generation figure (default 8; smoke 2)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per prompt (default 64; smoke 8)")
    parser.add_argument("--only", choices=("ipc",), help="measure this figure alone (a short device run)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed rounds, print torch.profiler's top operators of one step of each trainer")
    # The older spelling of --smoke, kept: the same flag (dest smoke), so its sizes are defaults as --smoke's.
    parser.add_argument("--cpu-smoke", dest="smoke", action="store_true", help="the same as --smoke")
    args = parse_with_smoke(parser, "no GPU: a tiny model on CPU, to check the script runs (CI)",
                            batch_size=4, seq_len=64, prompts=2, gen_tokens=8)
    if args.smoke:
        device, shape, autocast = "cpu", TINY, "none"
    elif torch.cuda.is_available():
        device, shape, autocast = "cuda:0", QWEN2_05B, "bfloat16"
    else:
        print("bench/gpu.py: no CUDA device here; nothing to measure (run it on a GPU machine, or --cpu-smoke)")
        return 0

    if args.only == "ipc":
        if not device.startswith("cuda"):
            print("bench/gpu.py --only ipc: the ipc handoff needs CUDA; nothing to measure")
            return 0
        record("gpu", {"device": torch.cuda.get_device_name(0), **ipc_figures(args)}, args=args)
        return 0

    from services.trainer.config import TrainerConfig
    from services.trainer.distributed import gather_buckets
    from services.trainer.loss_request import LossRequest
    from services.trainer.training import TrainingEngine

    loss = LossRequest(kind="dapo", is_cap=2.0)
    lr = 1e-6
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        path = build_model(Path(tmp) / "model", shape)
        batch = make_batch(args.batch_size, args.seq_len, shape["vocab_size"])
        tokens = int(batch["attention_mask"].sum())

        config = TrainerConfig.model_validate({
            "model": {"path": str(path), "device": device, "autocast": autocast},
            "optimizer": {"lr": lr, "weight_decay": 0.0},
            "limits": {"max_batch_tokens": 1 << 22},
            "checkpoint": {"dir": str(Path(tmp) / "ckpt")},
            "parallel": {"shard": True},
        })
        engine = TrainingEngine(config)
        engine.load()
        unsharded_config = config.model_copy(update={"parallel": config.parallel.model_copy(update={"shard": False})})
        unsharded = TrainingEngine(unsharded_config)
        unsharded.load()
        compiled = None
        if device.startswith("cuda"):
            compiled = TrainingEngine(unsharded_config.model_copy(
                update={"model": unsharded_config.model.model_copy(update={"compile": True})}))
            compiled.load()
        plain = PlainStep(path, device, lr, torch.bfloat16 if autocast == "bfloat16" else None)
        params = sum(p.numel() for p in plain.model.parameters())
        print(f"model: Qwen2 architecture, {params / 1e6:.0f}M parameters, random weights; device {device}; "
              f"batch {args.batch_size} x {args.seq_len} ({tokens} tokens)")

        ours: list[float] = []
        whole: list[float] = []
        base: list[float] = []
        fused: list[float] = []
        compile_figures: dict[str, float] = {}
        if compiled is not None:
            compile_figures["compiled_first_step_seconds"] = timed(lambda: compiled.train_step(batch, loss), device)
        for i in range(args.warmup + args.steps):
            t_ours = timed(lambda: engine.train_step(batch, loss), device)
            t_whole = timed(lambda: unsharded.train_step(batch, loss), device)
            t_fused = timed(lambda: compiled.train_step(batch, loss), device) if compiled is not None else 0.0
            t_base = timed(lambda: plain.step(batch), device)
            if i >= args.warmup:
                ours.append(t_ours)
                whole.append(t_whole)
                fused.append(t_fused)
                base.append(t_base)
        step_ours, step_whole, step_base = statistics.median(ours), statistics.median(whole), statistics.median(base)
        if compiled is not None:
            step_fused = statistics.median(fused)
            compile_figures.update(compiled_step_seconds=step_fused, compiled_step_vs_plain_step=step_base / step_fused)
        peaks = {}
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            engine.train_step(batch, loss)
            peaks["fsdp_step_peak_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            unsharded.train_step(batch, loss)
            peaks["unsharded_step_peak_bytes"] = torch.cuda.max_memory_allocated()
            if compiled is not None:
                torch.cuda.reset_peak_memory_stats()
                compiled.train_step(batch, loss)
                peaks["compiled_step_peak_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            plain.step(batch)
            peaks["plain_step_peak_bytes"] = torch.cuda.max_memory_allocated()

        if args.profile:
            profiled = {"sharded": lambda: engine.train_step(batch, loss),
                        "unsharded": lambda: unsharded.train_step(batch, loss)}
            if compiled is not None:
                profiled["compiled"] = lambda: compiled.train_step(batch, loss)
            profile_steps(profiled, device)

        bucket_bytes = args.bucket_mib << 20
        exported = {"bytes": 0}

        def export() -> None:
            with engine.lock:
                exported["bytes"] = sum(
                    t.numel() * t.element_size() for b in gather_buckets(engine.policy.model, bucket_bytes) for t in b.values()
                )

        copied = {"bytes": 0}
        e_ours, e_base = [], []
        for i in range(args.warmup + args.steps):
            t_ours = timed(export, device)
            t_base = timed(lambda: copied.__setitem__("bytes", plain.d2h()), device)
            if i >= args.warmup:
                e_ours.append(t_ours)
                e_base.append(t_base)
        export_ours, export_base = statistics.median(e_ours), statistics.median(e_base)
        assert exported["bytes"] == copied["bytes"], (exported, copied)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            export()
            peaks["export_peak_above_resident_bytes"] = torch.cuda.max_memory_allocated() - resident
        engine.close()
        unsharded.close()
        if compiled is not None:
            compiled.close()
        plain.model = plain.optimizer = None  # the GPU memory goes to the generation figure's models
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        gib = exported["bytes"] / 2**30
        print(f"{'':22}{'ours':>14}{'baseline':>14}{'ratio':>8}")
        print(f"{'step (s)':22}{step_ours:>14.4f}{step_base:>14.4f}{step_base / step_ours:>8.2f}   "
              f"trainer step (1-rank FSDP2) vs plain torch step; {tokens / step_ours:,.0f} vs "
              f"{tokens / step_base:,.0f} tokens/s")
        print(f"{'unsharded step (s)':22}{step_whole:>14.4f}{step_base:>14.4f}{step_base / step_whole:>8.2f}   "
              f"trainer step (no FSDP) vs plain torch step; {tokens / step_whole:,.0f} tokens/s")
        if compiled is not None:
            print(f"{'compiled step (s)':22}{step_fused:>14.4f}{step_base:>14.4f}{step_base / step_fused:>8.2f}   "
                  f"trainer step (no FSDP, model.compile) vs plain torch step; {tokens / step_fused:,.0f} tokens/s; "
                  f"its first step, compiling: {compile_figures['compiled_first_step_seconds']:.1f} s")
        else:
            print("compiled step: not measured on a CPU (inductor's compilation alone takes minutes there)")
        print(f"{'export (s)':22}{export_ours:>14.4f}{export_base:>14.4f}{export_base / export_ours:>8.2f}   "
              f"buckets gathered to host vs raw D2H copy of the same {gib:.2f} GiB; "
              f"{gib / export_ours:.2f} vs {gib / export_base:.2f} GiB/s")
        generation = generation_figures(Path(tmp), device, args.smoke, args)
        ipc = ipc_figures(args) if device.startswith("cuda") else {}

    for name, value in peaks.items():
        print(f"{name}: {value / 2**30:.2f} GiB")
    figures = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "parameters": params, "tokens_per_step": tokens,
        "fsdp_step_seconds": step_ours, "plain_step_seconds": step_base,
        "fsdp_step_vs_plain_step": step_base / step_ours,
        "unsharded_step_seconds": step_whole, "trainer_step_vs_plain_step": step_base / step_whole,
        **compile_figures,
        "export_bytes": exported["bytes"], "export_buckets_seconds": export_ours, "d2h_copy_seconds": export_base,
        "export_buckets_vs_d2h_copy": export_base / export_ours,
        **generation,
        **ipc,
        **peaks,
    }
    record("gpu", figures, args=args, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
