"""The `flywheel` command.

    flywheel run CONFIG         # a whole RL job locally (= python -m services.controller run CONFIG)
    flywheel up                 # start the four services locally; Ctrl-C or SIGTERM stops them
    flywheel up --check         # start them, check each is SERVING, stop, exit 0/1
    flywheel up --with tinker   # and the Tinker API over them (TINKER_BASE_URL=http://127.0.0.1:8096)
    flywheel health HOST:PORT   # ask one service for its gRPC health
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path


def _tiny_model() -> Path:
    from flywheel.models.smollm2 import model_cache_dir
    from flywheel.models.tiny import build_tiny_model

    out = model_cache_dir() / "tiny-flywheel-up"
    return out if (out / "config.json").is_file() else build_tiny_model(out, max_position_embeddings=512)


#: The modules Tinker's LoRA flags name (attention, MLP, output head) in the Llama and Qwen families.
TINKER_LORA_MODULES = '["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj","lm_head"]'


def _served_model(model: str, untied: Path, tinker: bool) -> str:
    """The model trainer and rollout load: with the Tinker API, an untied copy (at `untied`, made once)
    of a model that ties its output head to its embeddings (the head's adapter needs a head of its own:
    flywheel/models/untie.py)."""
    if not tinker:
        return model
    from flywheel.models.untie import ensure_untied

    return str(ensure_untied(model, untied))


def _up(args: argparse.Namespace) -> int:
    from flywheel.launcher.processes import SERVICES, ServiceDied, interrupt_on, start_service
    from flywheel.runtime.health import check_health
    from flywheel.runtime.http_server import http_ready_file

    tinker = "tinker" in (args.with_ or [])
    names = [*SERVICES, *(["tinker"] if tinker else [])]
    run_dir = Path(args.run_dir) / time.strftime("up-%Y%m%d-%H%M%S")
    print(f"starting {', '.join(names)} (logs in {run_dir})")
    # Trainer and rollout need a model: a tiny one (built once in the model cache) unless --model names one.
    # The tiny model's untied copy is kept beside it in the model cache; another model's, in the run directory.
    source = args.model or str(_tiny_model())
    model = _served_model(source, run_dir / "model-untied" if args.model else Path(source + "-untied"), tinker)
    checkpoints = run_dir.resolve() / "checkpoints"
    model_args = {
        "trainer": ("--model.path", model, "--checkpoint.dir", str(checkpoints)),
        "rollout": ("--engine.model-path", model, "--engine.kind", "transformers", "--http-port", "0"),
        "controller": ("--status-port", str(args.status_port)),
    }
    if tinker:  # the gateway's trainer trains LoRA adapters; its rollout loads the versions saved for sampling
        model_args["trainer"] += ("--model.lora.enabled", "true", "--model.lora.rank", str(args.lora_rank),
                                  "--model.lora.target-modules", TINKER_LORA_MODULES)
        model_args["rollout"] += ("--updates.checkpoint-root", str(checkpoints),
                                  "--adapters.max-resident", str(args.tinker_adapters))
    interrupt_on(signal.SIGINT, signal.SIGTERM)  # Ctrl-C, `kill` and a supervisor's stop all stop the services
    children = [start_service(name, run_dir, model_args.get(name, ())) for name in SERVICES]
    try:
        for child in children:
            child.wait_ready(args.timeout)
        if tinker:
            by_name = {child.name: child for child in children}
            children.append(start_service("tinker", run_dir, (
                "--trainer-address", by_name["trainer"].grpc_address,
                "--rollout-address", by_name["rollout"].grpc_address, "--http-port", str(args.tinker_port),
                "--checkpoint-dir", str(checkpoints / "tinker"), "--sampler-dir", str(checkpoints / "sampler"))))
            children[-1].wait_ready(args.timeout)
        failures = 0
        for child in children:
            status = asyncio.run(check_health(child.grpc_address))
            failures += status != "SERVING"
            print(f"  {child.name:<13} grpc {child.grpc_address:<18} metrics {child.metrics_url:<32} {status}")
        if tinker:
            port = json.loads(http_ready_file(children[-1].ready_path).read_text())["http_port"]
            from flywheel.runtime.auth import TOKEN_ENV, TOKEN_FILE_ENV, TOKENS_FILE_ENV

            keys = ("a tenant's key is the key (python -m flywheel.runtime.tokens tenant add NAME "
                    f"{os.environ.get(TOKENS_FILE_ENV) or 'TOKENS_FILE'}); the services' own token is refused"
                    if any(os.environ.get(v) for v in (TOKEN_ENV, TOKEN_FILE_ENV, TOKENS_FILE_ENV)) else
                    "no tokens are configured here, so any TINKER_API_KEY starting with tml- is accepted")
            print(f"Tinker API: TINKER_BASE_URL=http://127.0.0.1:{port} (base_model {model}); {keys}")
        if args.check:
            return 1 if failures else 0
        print("all services up; Ctrl-C (or SIGTERM) stops them")
        while True:
            for child in children:
                child.check_alive()
            time.sleep(0.5)
    except ServiceDied as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        codes = {child.name: child.stop() for child in children}
        print("stopped: " + ", ".join(f"{name} (exit {code})" for name, code in codes.items()))


def _health(args: argparse.Namespace) -> int:
    from flywheel.runtime.health import check_health

    status = asyncio.run(check_health(args.address, args.service))
    print(status)
    return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # the launcher parses its own options (services/controller/launcher/launch.py)
        from services.controller.launcher.launch import main as run_main

        return run_main(argv[1:])
    parser = argparse.ArgumentParser(prog="flywheel", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run an RL job locally: `flywheel run CONFIG` (see `flywheel run --help`)")
    up = sub.add_parser("up", help="start the four services as local processes (and the Tinker API, asked)")
    up.add_argument("--check", action="store_true", help="check health, stop everything and exit")
    up.add_argument("--run-dir", default=os.environ.get("FLYWHEEL_RUN_DIR", "runs"), help="parent of the logs directory")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds each service may take to become ready")
    up.add_argument("--model", default=None, help="HF model directory trainer and rollout load; default a tiny random one")
    up.add_argument("--status-port", type=int, default=8080, help="the controller's status page (0: a free port)")
    up.add_argument("--with", dest="with_", action="append", choices=["tinker"],
                    help="also start the Tinker API gateway (docs/tinker.md): the trainer then trains LoRA adapters")
    up.add_argument("--lora-rank", type=int, default=32, help="with tinker: the adapters' rank (the cookbook's default)")
    up.add_argument("--tinker-adapters", type=int, default=16,
                    help="with tinker: LoRA adapters the rollout serves side by side, each save for the sampler one "
                    "(the least recently used unloaded past it); 0: merged weights, one version at a time")
    up.add_argument("--tinker-port", type=int, default=8096, help="with tinker: the Tinker API's HTTP port (0: a free one)")
    up.set_defaults(func=_up)
    health = sub.add_parser("health", help="gRPC health of one service")
    health.add_argument("address", help="host:port")
    health.add_argument("--service", default="", help="service name; empty for the server as a whole")
    health.set_defaults(func=_health)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
