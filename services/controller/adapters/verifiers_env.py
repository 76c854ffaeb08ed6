"""The verifiers worker's environment: the verifiers host (adapters/verifiers_host.py), over HTTP.

With `worker.verifiers.url` the host is one you run; otherwise this starts it, with the
interpreter of verifiers' virtual environment (`worker.verifiers.python`), as a child of the
controller that ends with it, and forwards its output to the log. Every call has a deadline;
failures raise `flywheel.errors` (adapters/sessions.py's mapping of HTTP statuses).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from flywheel.errors import FailedPrecondition, InvalidArgument
from services.controller.adapters.sessions import http_request, json_object
from services.controller.adapters.verifiers_host import READY_LINE
from services.controller.run_config import VerifiersConfig
from services.controller.workers.verifiers import EpisodePlayed

log = logging.getLogger(__name__)

HOST_PROGRAM = Path(__file__).with_name("verifiers_host.py")
#: Deadline of a health check and of reading the host's answer beyond the episode's own limit.
CALL_SECONDS = 30.0


class VerifiersHost:
    def __init__(self, config: VerifiersConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.url = config.url.rstrip("/") if config.url else None
        self._process: asyncio.subprocess.Process | None = None
        self._output: asyncio.Task | None = None
        self._http = httpx.AsyncClient(timeout=CALL_SECONDS, transport=transport)

    async def start(self) -> None:
        """Starts the host (unless it is yours, at `url`) and checks it serves the configured taskset."""
        if self.url is None:
            self.url = await self._spawn()
        what = f"verifiers host {self.url}"
        try:
            health = json_object(await http_request(self._http, "GET", f"{self.url}/health", what), what)
            if self.config.taskset and health.get("taskset") != self.config.taskset:
                raise FailedPrecondition(f"{what} serves taskset {health.get('taskset')!r}, not "
                                         f"{self.config.taskset!r}")
        except BaseException:
            await self.close()
            raise
        log.info("verifiers host %s: taskset %s, harness %s, verifiers %s", self.url, health.get("taskset"),
                 health.get("harness"), health.get("verifiers"))

    async def _spawn(self) -> str:
        python = self.config.python or sibling_venv_python("verifiers")
        if not Path(python).exists():
            raise FailedPrecondition(f"worker.verifiers.python: no interpreter at {python} (make setup makes "
                                     ".venv-verifiers, with requirements/verifiers.txt)")
        args = [python, str(HOST_PROGRAM), "--taskset", self.config.taskset or "",
                "--taskset-args", json.dumps(self.config.taskset_args), "--harness", self.config.harness,
                "--max-concurrency", str(self.config.max_concurrency), "--exit-with-parent"]
        for directory in self.config.path:
            args += ["--path", str(Path(directory).resolve())]
        self._process = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self._process.stdout is not None
        seen: list[str] = []
        try:
            async with asyncio.timeout(self.config.startup_timeout_seconds):
                while True:
                    line = (await self._process.stdout.readline()).decode(errors="replace")
                    if not line:
                        raise FailedPrecondition("worker.verifiers: the verifiers host ended before it served:\n"
                                                 + "".join(seen[-30:]))
                    if line.startswith(READY_LINE):
                        url = line[len(READY_LINE):].strip()
                        break
                    seen.append(line)
        except TimeoutError:
            await self.close()
            raise FailedPrecondition(f"worker.verifiers: the verifiers host did not serve within "
                                     f"{self.config.startup_timeout_seconds:g}s:\n" + "".join(seen[-30:])) from None
        except BaseException:
            await self.close()
            raise
        self._output = asyncio.ensure_future(self._forward_output())
        return url

    async def _forward_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        while line := await self._process.stdout.readline():
            log.info("verifiers host: %s", line.decode(errors="replace").rstrip())

    async def play(self, task: dict[str, Any], base_url: str, api_key: str, sampling: dict[str, Any],
                   timeout_seconds: float) -> EpisodePlayed:
        if self.url is None:
            raise FailedPrecondition("the verifiers host is not started")
        what = f"verifiers host {self.url} episode of task {task.get('id')}"
        payload = json.dumps({"task": task, "base_url": base_url, "api_key": api_key, "sampling": sampling,
                              "timeout_seconds": timeout_seconds}, default=str)
        response = await http_request(self._http, "POST", f"{self.url}/episodes", what, content=payload,
                                  headers={"Content-Type": "application/json"},
                                  timeout=timeout_seconds + CALL_SECONDS)
        body = json_object(response, what)
        reward = body.get("reward")
        if body.get("ok") and not isinstance(reward, (int, float)):
            raise InvalidArgument(f"{what}: an ok episode without a numeric reward: {reward!r}")
        scores = {f"env_{k}": float(v) for k, v in (body.get("metrics") or {}).items()}
        scores.update({k: float(v) for k, v in (body.get("rewards") or {}).items()})
        if body.get("turns") is not None:
            scores["env_turns"] = float(body["turns"])
        errors = [f"{e.get('type')}: {e.get('message')}" for e in body.get("errors") or ()]
        return EpisodePlayed(ok=bool(body.get("ok")), reward=float(reward) if body.get("ok") else None,
                             scores=scores, errors=errors)

    async def close(self) -> None:
        await self._http.aclose()
        if self._process is not None and self._process.returncode is None:
            self._process.terminate()
            try:
                await asyncio.wait_for(self._process.wait(), 10)
            except TimeoutError:
                self._process.kill()
                await self._process.wait()
        if self._output is not None:
            self._output.cancel()


def sibling_venv_python(name: str) -> str:
    """The interpreter of the virtual environment `<this one>-<name>` (.venv -> .venv-verifiers)."""
    prefix = Path(sys.prefix)
    return str(prefix.with_name(f"{prefix.name}-{name}") / "bin" / "python")
