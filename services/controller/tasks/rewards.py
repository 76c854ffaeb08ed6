"""Rewards: plain Python functions, sync or async, registered by name.

A reward is called as `fn(task, completion, **kwargs)` where `task` is the
`Task` (prompt, answer, the whole row in `task.data`) and `completion` the
text of the completion (for agents, of the whole episode). It returns a
number, or a dict of named scores that includes "reward". A reward that
raises does not stop the run: `score()` raises `RewardError`, which the
worker turns into a failed trajectory with the error recorded.

    @register_reward("contains_yes")
    def contains_yes(task, completion):
        return float("yes" in completion.lower())

Rewards named in the config as "module:function" are imported on demand.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from services.controller.tasks.answers import answers_match, final_answer, reference_answer
from services.controller.domain import Task

RewardResult = float | int | bool | dict[str, float]
RewardFn = Callable[..., RewardResult | Awaitable[RewardResult]]

_REGISTRY: dict[str, RewardFn] = {}


class RewardError(Exception):
    """A reward function raised or returned something unusable."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def decorate(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return decorate


def import_object(spec: str) -> Any:
    """The object named by 'package.module:attr'."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{spec!r} is not of the form 'module:attr'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name} has no attribute {attr!r}") from None


def get_reward(name: str) -> RewardFn:
    """A registered reward, or one imported from 'module:function'."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        fn = import_object(name)
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        return fn
    raise ValueError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY)} (or give 'module:function')")


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


async def score(fn: RewardFn, task: Task, completion: str, **kwargs: Any) -> tuple[float, dict[str, float]]:
    """(reward, scores) of one completion; RewardError if the function fails."""
    try:
        result = fn(task, completion, **kwargs)
        if inspect.isawaitable(result):
            result = await result
    except Exception as exc:  # user code: anything may go wrong; the run goes on
        raise RewardError(f"{type(exc).__name__}: {exc}") from exc
    if isinstance(result, dict):
        if "reward" not in result:
            raise RewardError(f"reward returned a dict without 'reward' (keys: {sorted(result)})")
        scores = {k: float(v) for k, v in result.items()}
    elif isinstance(result, (int, float, bool)):
        scores = {"reward": float(result)}
    else:
        raise RewardError(f"reward returned a {type(result).__name__}, expected a number or a dict")
    if scores["reward"] != scores["reward"]:  # NaN would poison the group's advantages
        raise RewardError("reward returned NaN")
    return scores["reward"], scores


@register_reward("math")
def math_reward(task: Task, completion: str, *, format_bonus: float = 0.0) -> dict[str, float]:
    """1 if the final answer (last \\boxed{}, else last number) equals the reference."""
    if task.answer is None:
        raise ValueError(f"task {task.id} has no reference answer")
    answer, boxed = final_answer(completion)
    correct = answers_match(answer, task.answer)
    return {
        "reward": float(correct) + (format_bonus if boxed else 0.0),
        "accuracy": float(correct),
        "boxed": float(boxed),
    }


@register_reward("exact_match")
def exact_match(task: Task, completion: str) -> dict[str, float]:
    """1 if the stripped completion equals the stripped reference answer."""
    correct = completion.strip() == reference_answer(task.answer)
    return {"reward": float(correct), "accuracy": float(correct)}


@register_reward("length")
def length_reward(task: Task, completion: str, *, target: int = 100) -> float:
    """Closeness of the completion's length (characters) to a target; a smoke-test reward."""
    return -abs(len(completion) - target) / max(target, 1)
