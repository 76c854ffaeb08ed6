"""The `flywheel` command.

    flywheel run CONFIG         # a whole RL job locally (= python -m services.controller run CONFIG)
    flywheel up                 # start the four services locally; Ctrl-C stops them
    flywheel up --check         # start them, check each is SERVING, stop, exit 0/1
    flywheel health HOST:PORT   # ask one service for its gRPC health
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path


def _tiny_model() -> Path:
    from flywheel.models.smollm2 import model_cache_dir
    from flywheel.models.tiny import build_tiny_model

    out = model_cache_dir() / "tiny-flywheel-up"
    return out if (out / "config.json").is_file() else build_tiny_model(out, max_position_embeddings=512)


def _up(args: argparse.Namespace) -> int:
    from flywheel.launcher.processes import SERVICES, ServiceDied, start_service
    from flywheel.runtime.health import check_health

    run_dir = Path(args.run_dir) / time.strftime("up-%Y%m%d-%H%M%S")
    print(f"starting {', '.join(SERVICES)} (logs in {run_dir})")
    # Trainer and rollout need a model: a tiny one (built once in the model cache) unless --model names one.
    model = args.model or str(_tiny_model())
    model_args = {
        "trainer": ("--model.path", model),
        "rollout": ("--engine.model-path", model, "--engine.kind", "transformers", "--http-port", "0"),
    }
    children = [start_service(name, run_dir, model_args.get(name, ())) for name in SERVICES]
    try:
        for child in children:
            child.wait_ready(args.timeout)
        failures = 0
        for child in children:
            status = asyncio.run(check_health(child.grpc_address))
            failures += status != "SERVING"
            print(f"  {child.name:<13} grpc {child.grpc_address:<18} metrics {child.metrics_url:<32} {status}")
        if args.check:
            return 1 if failures else 0
        print("all services up; Ctrl-C stops them")
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
    up = sub.add_parser("up", help="start the four services as local processes")
    up.add_argument("--check", action="store_true", help="check health, stop everything and exit")
    up.add_argument("--run-dir", default=os.environ.get("FLYWHEEL_RUN_DIR", "runs"), help="parent of the logs directory")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds each service may take to become ready")
    up.add_argument("--model", default=None, help="HF model directory trainer and rollout load; default a tiny random one")
    up.set_defaults(func=_up)
    health = sub.add_parser("health", help="gRPC health of one service")
    health.add_argument("address", help="host:port")
    health.add_argument("--service", default="", help="service name; empty for the server as a whole")
    health.set_defaults(func=_health)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
