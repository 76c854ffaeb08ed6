"""`python -m services.<name>`: parse the config, then import and run the service.

Only pydantic and yaml are imported before arguments are parsed, so `--help`
and `--print-config` answer instantly; torch, vLLM and grpc are imported by
the service's `build` function afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import sys
from collections.abc import Sequence

from pydantic import BaseModel

from flywheel.launcher.processes import die_with_launcher
from flywheel.runtime.config import ConfigError, load_config, redacted
from flywheel.runtime.logging import configure_logging
from flywheel.runtime.triton_gate import keep_triton_out

log = logging.getLogger("flywheel.entry")

# At import: before the service's build imports torch (a service's __main__ imports this module first).
keep_triton_out()


def env_prefix(service: str) -> str:
    """Prefix of the env variables that configure a service, e.g. FLYWHEEL_TRAINER__."""
    return f"FLYWHEEL_{service.upper()}__"


def skip_teardown_collection() -> None:
    """For a process whose work is done: the interpreter's teardown collects garbage over every
    object torch and the model made (a second and more of a trainer's or a vLLM worker's stop,
    measured on 2 cores), for memory the exit frees anyway. Frozen objects are skipped by it;
    atexit handlers still run, and nothing of ours waits on that collection."""
    gc.freeze()


def run_main(
    *,
    service: str,
    config_cls: type[BaseModel],
    description: str,
    build: str,
    argv: Sequence[str] | None = None,
) -> None:
    """Entry point of a service; `build` is "module:function" returning a ServiceSpec."""
    die_with_launcher()
    config = load_config(
        config_cls, argv, prog=f"python -m services.{service}", description=description, env_prefix=env_prefix(service),
        section=service,
    )
    server = config.server  # type: ignore[attr-defined]
    configure_logging(service, server.log_level, server.log_format)
    log.info("config resolved", extra={"config": redacted(config)})

    from flywheel.runtime.server import serve  # heavy imports only after parsing

    module_name, func_name = build.split(":")
    try:
        spec = getattr(importlib.import_module(module_name), func_name)(config)
        asyncio.run(serve(spec, server))
        skip_teardown_collection()
    except KeyboardInterrupt:
        pass
    except ConfigError as exc:  # a setting the service cannot work with: say which, no traceback
        log.error("%s: %s", service, exc)
        print(f"python -m services.{service}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception:
        log.exception("%s failed", service)
        sys.exit(1)
