"""Rewards for the learning smoke test, loaded by the controller as 'module:function'."""

from __future__ import annotations

from services.controller.domain import Task


def starts_with_a_vowel(task: Task, completion: str) -> dict[str, float]:
    """1 if the completion's first letter is a vowel. A random model scores about a third (its samples
    differ, so GRPO has spread at once); the credit lies on the first tokens, so a tiny model learns
    it in a few steps. A flipped advantage sign drives it down instead; stale weights leave it flat."""
    first = next((c for c in completion.lower() if c.isalpha()), "")
    hit = float(first in "aeiou" and first != "")
    return {"reward": hit, "accuracy": hit}


def starts_with_a(task: Task, completion: str) -> dict[str, float]:
    hit = float(completion.strip().lower().startswith("a"))
    return {"reward": hit, "accuracy": hit}
