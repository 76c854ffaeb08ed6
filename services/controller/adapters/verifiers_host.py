"""The verifiers host: plays episodes of one verifiers environment against Flywheel rollout sessions.

It runs in the virtual environment verifiers is installed in (`.venv-verifiers`, from
requirements/verifiers.txt), as a process of its own that the verifiers worker's adapter
(adapters/verifiers_env.py) starts, or that you start yourself and name by URL. verifiers pins
packages Flywheel's own environment cannot hold (mcp 2.0.0, openai < 3), so this file imports
only verifiers, aiohttp (a dependency of verifiers) and the standard library, never Flywheel.

    python verifiers_host.py --taskset ID [--taskset-args JSON] [--harness null] [--path DIR]...
                             [--host 127.0.0.1] [--port 0] [--max-concurrency 32]

prints `flywheel-verifiers-host listening on http://HOST:PORT` once it serves:

    GET  /health    -> {"taskset", "harness", "verifiers"}
    GET  /tasks     -> {"rows": [...]}: the taskset's own tasks (its `load()`), one row each, as
                       TaskData fields: what `export` writes as a run's data file
    POST /episodes  {"task": {"id", "prompt", "data"}, "base_url", "api_key", "sampling", "timeout_seconds"}
                    -> {"ok", "reward", "rewards", "metrics", "stop_condition", "turns", "errors"}

An episode is what verifiers' own env server does with a dispatched task: the task's row (its
`data`, with `prompt` from the task when the row has none, and `idx` from the row or the task's
id) is validated into the taskset's TaskData, and the environment runs it with the taskset's
harness (`null`: verifiers' plain chat loop, in a subprocess runtime) against `base_url`, the
episode's session on a Flywheel rollout replica. The session records every token the model
made, so what Flywheel trains is what was sampled; this host only reports the reward. verifiers
reads an endpoint's key from an environment variable, so each episode's session key is set
under a name of its own for the episode's length.

`ok` is false, with the errors, when verifiers recorded any (a model call that failed, a reward
that raised, a stage past its deadline) or a reward did not run; the worker then trains
nothing of the episode. An environment with more than one trainable agent is refused: a session
trains one conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
import zlib
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

READY_LINE = "flywheel-verifiers-host listening on"


def _taskset_environment(taskset: str, taskset_args: dict[str, Any], harness: str) -> Any:
    from verifiers.v1.utils.loaders import load_environment
    import verifiers.v1 as vf

    config = vf.SingleAgentEnvConfig.model_validate({
        "taskset": {**taskset_args, "id": taskset},
        # The subprocess runtime: the harness runs on this machine, next to the rollout's session URL.
        "agent": {"harness": {"id": harness}, "runtime": {"type": "subprocess"}},
    })
    return load_environment(config)


def _task_data(env: Any, task: dict[str, Any]) -> Any:
    """The taskset's Task for a run's task, built as verifiers' env server builds a dispatched one."""
    taskset = env.taskset
    task_cls = type(taskset).task_type()
    row = dict(task.get("data") or {})
    row.setdefault("prompt", task.get("prompt"))
    row.setdefault("idx", zlib.crc32(str(task.get("id", "")).encode()))
    return task_cls(task_cls.data_type().model_validate(row), env.config.taskset.task)


async def _model_name(base_url: str, api_key: str) -> str:
    """The model the session's replica serves (its /models), which every request must name."""
    async with ClientSession(timeout=ClientTimeout(total=30)) as http:
        async with http.get(f"{base_url.rstrip('/')}/models", headers={"Authorization": f"Bearer {api_key}"}) as r:
            body = await r.json(content_type=None)
            if r.status != 200:
                raise RuntimeError(f"GET {base_url}/models: HTTP {r.status}: {body}")
            return str(body["data"][0]["id"])


def _report(episode: Any) -> dict[str, Any]:
    errors = [{"type": e.type, "message": e.message} for e in episode.errors]
    trainable = [t for t in episode.traces if getattr(getattr(t, "agent", None), "trainable", True)]
    if len(trainable) != 1:
        errors.append({"type": "Refused", "message": f"the episode has {len(trainable)} trainable agents' traces; "
                       "a Flywheel session trains one conversation"})
        return {"ok": False, "reward": None, "errors": errors}
    trace = trainable[0]
    errors += [{"type": e.type, "message": e.message} for e in trace.errors]
    errors += [{"type": "ModelCall", "message": f"{c.error.type}: {c.error.message}"} for c in trace.calls if c.error]
    not_scored = [name for name, r in trace.rewards.items() if r is None]
    if not_scored:
        errors.append({"type": "NotScored", "message": f"rewards that did not run: {', '.join(not_scored)}"})
    ok = trace.ok and not errors
    return {
        "ok": ok,
        "reward": trace.reward if ok else None,
        "rewards": {name: r.score for name, r in trace.rewards.items() if r is not None},
        "metrics": {k: v for k, v in trace.metrics.items() if isinstance(v, (int, float))},
        "stop_condition": trace.stop_condition,
        "turns": len(trace.calls),
        "errors": errors,
    }


class Host:
    def __init__(self, env: Any, harness: str, max_concurrency: int) -> None:
        self.env, self.harness = env, harness
        # verifiers' own episode bound (run_slot holds one permit an episode).
        self.gate = asyncio.Semaphore(max_concurrency)

    async def health(self, request: web.Request) -> web.Response:
        import verifiers

        return web.json_response({"taskset": self.env.config.taskset.id, "harness": self.harness,
                                  "verifiers": verifiers.__version__})

    async def tasks(self, request: web.Request) -> web.Response:
        rows = [t.data.model_dump(mode="json", exclude_none=True) for t in self.env.taskset.load()]
        return web.json_response({"rows": rows})

    async def episode(self, request: web.Request) -> web.Response:
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import EvalClientConfig
        from verifiers.v1.types import SamplingConfig

        try:
            body = await request.json()
            task = _task_data(self.env, body["task"])
            base_url, api_key = str(body["base_url"]), str(body["api_key"])
            sampling = SamplingConfig.model_validate(body.get("sampling") or {})
            timeout = float(body.get("timeout_seconds") or 300)
        except Exception as exc:  # the body, or a row the taskset's TaskData refuses
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=400)
        key_var = f"FLYWHEEL_SESSION_KEY_{uuid.uuid4().hex}"
        os.environ[key_var] = api_key
        try:
            async with asyncio.timeout(timeout):
                model = await _model_name(base_url, api_key)
                ctx = ModelContext(client=EvalClientConfig(base_url=base_url, api_key_var=key_var), model=model,
                                   sampling=sampling)
                (slot,) = self.env.slots(task)
                episode = await self.env.run_slot(slot, ctx, self.gate)
        except TimeoutError:
            return web.json_response({"ok": False, "reward": None,
                                      "errors": [{"type": "Timeout", "message": f"past {timeout:g}s"}]})
        except Exception as exc:
            return web.json_response({"ok": False, "reward": None,
                                      "errors": [{"type": type(exc).__name__, "message": str(exc)}]})
        finally:
            os.environ.pop(key_var, None)
        return web.json_response(_report(episode))


async def _exit_with_parent(parent: int) -> None:
    """A host started by a controller ends with it, even one killed without a word."""
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    os._exit(0)


async def serve(args: argparse.Namespace) -> None:
    env = _taskset_environment(args.taskset, json.loads(args.taskset_args), args.harness)
    host = Host(env, args.harness, args.max_concurrency)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes([web.get("/health", host.health), web.get("/tasks", host.tasks),
                    web.post("/episodes", host.episode)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the port the system gave for --port 0
    print(f"{READY_LINE} http://{args.host}:{port}", flush=True)
    if args.exit_with_parent:
        asyncio.get_running_loop().create_task(_exit_with_parent(os.getppid()))
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--taskset", required=True, help="the id of an installed verifiers taskset")
    parser.add_argument("--taskset-args", default="{}", help="the taskset's config, as JSON")
    parser.add_argument("--harness", default="null", help="the verifiers harness the model runs in")
    parser.add_argument("--path", action="append", default=[], help="a directory put on the import path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-concurrency", type=int, default=32, help="episodes played at once")
    parser.add_argument("--exit-with-parent", action="store_true", help="end when the process that started it ends")
    args = parser.parse_args(argv)
    sys.path[:0] = args.path
    # The runtime's programs find `uv` beside this interpreter (it is in requirements/verifiers.txt).
    os.environ["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
