"""A remote judge: a reward that asks an HTTP scoring service for each completion.

`RemoteJudge` is called like any reward, `judge(task, completion)`, and
returns {"reward": x, ...scores}; the rollout workers await it after the
group's generation is done, when the task's generation slot has already gone
to the next task (`GENERATION_DONE`), so a judge that takes seconds does not
stall generation. Each judgement is up to `max_attempts` calls, each with
its own deadline (`timeout_seconds`), retried after a doubling backoff. A
judgement whose every call failed (an error answer, a late one, a masked
sample, an answer without a usable reward) raises `JudgeFailed`: its
trajectory fails with the reason, is counted, and is never trained as a
reward of 0. After `max_consecutive_failures` failed judgements in a row the
run is told with a critical error, and its error policy decides.

The bodies, by `format` (docs/remote-judge.md has examples):
- flywheel: {"prompt": text or chat messages, "completion": text,
  "metadata": {"task_id", "split", "answer", "data": the dataset row}}
  answered {"reward": x, "scores": {name: number}} or a bare number;
- slime (its `remote_rm`): {"prompt", "response", "label": the answer}
  answered with a number (or {"reward": x});
- nemo_gym (a resources server's `/verify`): the row's fields, plus
  {"responses_create_params": the row's own or {"input": messages},
  "response": a Responses API object holding the completion}, answered
  {"reward": x, ...}; `mask_sample: true` (the judge could not measure it)
  is a failed judgement.

The transport (`post`) is an adapter (services/controller/adapters/judge_http.py
for HTTP); tests pass a simulated one.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from services.controller.domain import Task
from services.controller.run_config import JudgeConfig
from services.controller.telemetry.errors_report import ErrorReporter

#: Sends one body to the judge and returns its parsed JSON answer; raises on a failed call.
Post = Callable[[dict[str, Any]], Awaitable[Any]]

#: The counters a judge keeps (`judge/<name>_total` in metrics.jsonl, every step, zeros included).
COUNTERS = ("calls", "judged", "failed", "retries", "timeouts")


class JudgeFailed(Exception):
    """Every call of one judgement failed; the message says why the last one did."""


class BadAnswer(Exception):
    """The judge answered, but not with a usable reward."""


def _messages(prompt: Any) -> list[dict[str, Any]]:
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def request_body(fmt: str, task: Task, completion: str) -> dict[str, Any]:
    """What is POSTed for one completion of `task`, in the judge's `fmt`."""
    if fmt == "slime":
        return {"prompt": task.prompt, "response": completion, "label": task.answer}
    if fmt == "nemo_gym":
        row = dict(task.data)
        response = {
            "id": f"resp_{task.id}", "object": "response", "created_at": int(time.time()), "model": "policy",
            "status": "completed", "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "output": [{"type": "message", "id": f"msg_{task.id}", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": completion, "annotations": []}]}],
        }
        params = row.get("responses_create_params") or {"input": _messages(task.prompt)}
        return {**row, "responses_create_params": params, "response": response}
    return {"prompt": task.prompt, "completion": completion,
            "metadata": {"task_id": task.id, "split": task.split, "answer": task.answer, "data": dict(task.data)}}


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadAnswer(f"{what} is {value!r}, not a finite number")
    return float(value)


def read_answer(fmt: str, answer: Any) -> dict[str, float]:
    """{"reward": x, ...named scores} from the judge's answer; BadAnswer when it holds none."""
    if fmt == "nemo_gym" and isinstance(answer, dict) and answer.get("mask_sample"):
        raise BadAnswer("the judge masked the sample (mask_sample: its reward is not a measurement)")
    if not isinstance(answer, dict):
        return {"reward": _number(answer, "the answer")}
    if "reward" not in answer:
        raise BadAnswer(f"the answer has no reward (keys: {sorted(answer)[:8]})")
    scores = {"reward": _number(answer["reward"], "reward")}
    extra = answer.get("scores") if fmt == "flywheel" else None
    if extra is not None:
        if not isinstance(extra, dict):
            raise BadAnswer("scores: must be an object of numbers")
        scores.update({str(k): _number(v, f"scores.{k}") for k, v in extra.items() if k != "reward"})
    return scores


class RemoteJudge:
    def __init__(self, config: JudgeConfig, post: Post, errors: ErrorReporter | None = None) -> None:
        self.config = config
        self._post = post
        self.errors = errors
        self.stats: Counter[str] = Counter({name: 0 for name in COUNTERS})
        #: Failed judgements since the last one that succeeded.
        self.failed_in_a_row = 0
        self._calls = asyncio.Semaphore(config.max_concurrency)

    async def __call__(self, task: Task, completion: str, **kwargs: Any) -> dict[str, float]:
        cfg = self.config
        body = request_body(cfg.format, task, completion)
        why = ""
        for attempt in range(cfg.max_attempts):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(cfg.retry_backoff_seconds * 2 ** (attempt - 1))
            try:
                async with self._calls:  # the deadline is the call's, not its wait for a connection
                    self.stats["calls"] += 1
                    answer = await asyncio.wait_for(self._post(body), cfg.timeout_seconds)
                scores = read_answer(cfg.format, answer)
            except TimeoutError:
                self.stats["timeouts"] += 1
                why = f"no answer within {cfg.timeout_seconds:g} s (reward.judge.timeout_seconds)"
            except Exception as exc:  # noqa: BLE001 - a failed call, whatever failed; retried, then reported
                why = str(exc) if isinstance(exc, BadAnswer) else f"{type(exc).__name__}: {exc}"
            else:
                self.stats["judged"] += 1
                self.failed_in_a_row = 0
                return scores
        self._failed(why)
        raise JudgeFailed(f"the judge at {cfg.url} failed {cfg.max_attempts} call(s); the last: {why}")

    def _failed(self, why: str) -> None:
        self.stats["failed"] += 1
        self.failed_in_a_row += 1
        limit = self.config.max_consecutive_failures
        if self.failed_in_a_row == limit and self.errors is not None:
            self.errors.report(
                "judge", f"the remote judge at {self.config.url} failed {limit} judgements in a row "
                f"(reward.judge.max_consecutive_failures); the last: {why}", severity="critical")

    def metrics(self) -> dict[str, float]:
        return {f"judge/{name}_total": float(self.stats[name]) for name in COUNTERS}
