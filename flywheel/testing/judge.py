"""SIMULATION, for tests and bench/remote_judge.py only: a remote judge that
fails some calls and answers others too late, the same judge behind a real
HTTP server, and a clock of how long generation sat idle.

- `FlakyJudge` is a judge's transport (services/controller/tasks/judge.Post):
  each call fails with probability `fail`, hangs past any deadline with
  probability `late`, and otherwise answers after `latency()` seconds with
  the completion's own reward, `reward_of(completion)` (never 0, so a failed
  judgement that turned into a 0 would show).
- `judge_server` serves a FlakyJudge's answers over HTTP (POST, any path)
  from a process of its own, as a judge service would: failures as HTTP 500.
- `GenerationClock` wraps a rollout engine's `generate` and measures the
  share of the time between the first generation's start and the last one's
  end during which none ran.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: How long a late call hangs: past any deadline a test sets.
LATE_SECONDS = 3600.0


def reward_of(completion: str) -> float:
    """The reward the simulated judge gives a completion: in (0, 1], a function of its text alone."""
    return (zlib.crc32(completion.encode()) % 1000 + 1) / 1000


class FlakyJudge:
    def __init__(self, *, fail: float = 0.0, late: float = 0.0, latency: Callable[[], float] = lambda: 0.0,
                 seed: int = 0, fmt: str = "flywheel") -> None:
        self.fail, self.late, self.latency, self.fmt = fail, late, latency, fmt
        self.rng = random.Random(seed)
        self.calls: Counter[str] = Counter()

    def completion_of(self, body: dict[str, Any]) -> str:
        if self.fmt == "slime":
            return body["response"]
        if self.fmt == "nemo_gym":
            return body["response"]["output"][0]["content"][0]["text"]
        return body["completion"]

    async def __call__(self, body: dict[str, Any]) -> Any:
        draw = self.rng.random()
        if draw < self.fail:
            self.calls["failed"] += 1
            await asyncio.sleep(self.latency() / 10)
            raise RuntimeError("simulated judge failure (HTTP 500)")
        if draw < self.fail + self.late:
            self.calls["late"] += 1
            await asyncio.sleep(LATE_SECONDS)
        await asyncio.sleep(self.latency())
        self.calls["answered"] += 1
        reward = reward_of(self.completion_of(body))
        return reward if self.fmt == "slime" else {"reward": reward}


def _serve(port_out: Any, fail: float, late: float, latency_seconds: float, seed: int) -> None:
    """The judge server's process: a FlakyJudge behind uvicorn, its port sent to the parent."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    rng = random.Random(seed)
    judge = FlakyJudge(fail=fail, late=late, seed=seed,
                       latency=lambda: rng.lognormvariate(math.log(latency_seconds) - 0.125, 0.5) if latency_seconds else 0)

    async def verify(request: Request) -> JSONResponse:
        try:
            return JSONResponse(await judge(json.loads(await request.body())))
        except RuntimeError as exc:
            return JSONResponse({"error": str(exc)}, status_code=500)

    app = Starlette(routes=[Route("/{path:path}", verify, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port_out.put(sock.getsockname()[1])
    uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off")).run(sockets=[sock])


@contextmanager
def judge_server(*, fail: float = 0.0, late: float = 0.0, latency_seconds: float = 0.0, seed: int = 0) -> Iterator[str]:
    """A FlakyJudge served over HTTP on 127.0.0.1, in a process of its own (the caller's event loop and
    GIL stay the caller's): its URL. Its latency is lognormal (log-std 0.5) with the given mean."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    port_out = context.Queue()
    process = context.Process(target=_serve, args=(port_out, fail, late, latency_seconds, seed), daemon=True,
                              name="judge-server")
    process.start()
    try:
        port = port_out.get(timeout=60)
        deadline = time.monotonic() + 30
        while True:  # listening once it accepts a connection
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or not process.is_alive():
                    raise RuntimeError("the simulated judge server did not start") from None
                time.sleep(0.02)
        yield f"http://127.0.0.1:{port}/verify"
    finally:
        # Killed, not terminated: uvicorn's graceful stop would wait for the calls that hang on purpose.
        process.kill()
        process.join(10)


class GenerationClock:
    """Idle time of generation: wrap each engine, run, then read `idle_fraction`."""

    def __init__(self) -> None:
        self.running = 0
        self.first: float | None = None
        self.last_end = 0.0
        self.idle_seconds = 0.0
        self._idle_since: float | None = None

    def wrap(self, engine: Any) -> Any:
        generate = engine.generate

        async def timed(*args: Any, **kwargs: Any) -> Any:
            self._started()
            try:
                return await generate(*args, **kwargs)
            finally:
                self._ended()

        engine.generate = timed
        return engine

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _started(self) -> None:
        now = self._now()
        if self.first is None:
            self.first = now
        if self.running == 0 and self._idle_since is not None:
            self.idle_seconds += now - self._idle_since
        self.running += 1

    def _ended(self) -> None:
        self.running -= 1
        self.last_end = self._now()
        if self.running == 0:
            self._idle_since = self.last_end

    @property
    def idle_fraction(self) -> float:
        if self.first is None or self.last_end <= self.first:
            return 0.0
        return self.idle_seconds / (self.last_end - self.first)
