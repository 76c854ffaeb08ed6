"""The reward of the learning smoke test, loaded by the controller as 'module:function'."""

from __future__ import annotations

from services.controller.domain import Task


def starts_with_a(task: Task, completion: str) -> dict[str, float]:
    """1 if the completion starts with the letter "a": one fixed answer, whatever the question. A random
    tiny model scores about 5-10% (enough spread for GRPO with groups of 8), the credit lies on the first
    token, and it learns it in a few steps. A flipped advantage sign, a wrong mask or rollouts that keep
    stale weights leave it flat or drive it down."""
    hit = float(completion.strip().lower().startswith("a"))
    return {"reward": hit, "accuracy": hit}
