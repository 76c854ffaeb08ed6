"""Advantage estimation and group filtering: GRPO, DAPO, overlong handling.

An algorithm is a callable `(group) -> drop reason or None` over one released
group of trajectories: it may shape rewards, must set `advantage` on every
trajectory it keeps, and returns a reason string to drop the whole group
instead (the processor then frees the group's slots so rollouts refill the
batch: DAPO's dynamic sampling).

- `grpo_advantages`: A_i = (r_i - mean(r)) / (std(r) + eps), std the unbiased
  sample std (as torch.std and verl); without std-normalisation A_i = r_i - mean(r)
  (Dr. GRPO). A group of one gets 0.
- dynamic sampling: a group whose rewards are all equal has zero advantage
  everywhere and teaches nothing: drop it.
- overlong penalty (DAPO's soft punishment): 0 up to max_length - buffer,
  then falling linearly to -factor at max_length, -factor beyond.
- overlong filter: truncated completions stay in the group (their rewards
  count for the baseline) but leave the loss (response mask zeroed).

- distillation (`distilled`, with algorithm.teacher): every token's advantage
  is kl_coef x (teacher log-prob - sampling log-prob), the negative of the
  per-token reverse KL to the teacher (its expectation under the student's
  samples is -KL(student || teacher)), plus reward_coef x the group's advantage.

Plug your own in with `algorithm.name: "module:function"`: the function gets
the group and follows the same contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.controller.domain import FinishReason, Trajectory

Algorithm = Callable[[list[Trajectory]], "str | None"]

EPS = 1e-6


def grpo_advantages(rewards: Sequence[float], *, normalize_std: bool = True, eps: float = EPS) -> list[float]:
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    if n < 2:
        return [0.0] * n
    std = math.sqrt(sum(c * c for c in centred) / (n - 1))
    return [c / (std + eps) for c in centred]


def overlong_penalty(length: int, max_length: int, buffer_length: int, factor: float = 1.0) -> float:
    start = max_length - buffer_length
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer_length * factor
    return -factor


def all_equal(values: Sequence[float], tol: float = 1e-9) -> bool:
    return max(values) - min(values) <= tol if values else True


@dataclass
class GroupAlgorithm:
    """GRPO-family processing of one group; DAPO is this with its switches on."""

    normalize_std: bool = True
    dynamic_sampling: bool = False
    overlong_filter: bool = False
    overlong_penalty: bool = False
    max_length: int = 256
    buffer_length: int = 64
    penalty_factor: float = 1.0

    def __call__(self, group: list[Trajectory]) -> str | None:
        if self.overlong_penalty:
            for t in group:
                # Counts policy tokens only: tool output is not the model's verbosity.
                length = sum(t.response_mask)
                p = overlong_penalty(length, self.max_length, self.buffer_length, self.penalty_factor)
                t.scores["overlong_penalty"] = p
                t.reward += p
        rewards = [t.reward for t in group]
        if self.dynamic_sampling and len(group) > 1 and all_equal(rewards):
            return "equal_rewards"
        for t, a in zip(group, grpo_advantages(rewards, normalize_std=self.normalize_std)):
            t.advantage = a
        if self.overlong_filter:
            for t in group:
                if t.finish_reason == FinishReason.LENGTH:
                    t.response_mask = [0] * len(t.response_mask)
            if all(sum(t.response_mask) == 0 for t in group):
                return "all_overlong"
        return None


def distill_advantages(t: Trajectory, kl_coef: float, reward_coef: float) -> list[float]:
    """Per response token: kl_coef x (teacher - sampling log-prob) + reward_coef x the sequence's advantage;
    0 where the token is not the policy's (tool or environment output)."""
    if t.teacher_logprobs is None or len(t.teacher_logprobs) != len(t.response_ids):
        raise ValueError(f"trajectory of task {t.task.id}: no teacher log-prob for each of its {len(t.response_ids)} "
                         "response tokens")
    shared = reward_coef * (t.advantage or 0.0)
    return [kl_coef * (teacher - sampled) + shared if mask else 0.0
            for teacher, sampled, mask in zip(t.teacher_logprobs, t.response_logprobs, t.response_mask)]


def distilled(algorithm: Algorithm, kl_coef: float, reward_coef: float) -> Algorithm:
    """`algorithm` (its group advantage of the task reward, its filters), then each kept trajectory's
    per-token advantages against the teacher (`distill_advantages`)."""

    def process(group: list[Trajectory]) -> str | None:
        reason = algorithm(group)
        if reason is None:
            for t in group:
                t.token_advantages = distill_advantages(t, kl_coef, reward_coef)
        return reason

    return process


def make_algorithm(cfg) -> Algorithm:
    """The algorithm of a `RunConfig` (distilled against its teacher when it names one)."""
    algorithm = _group_algorithm(cfg)
    teacher = cfg.algorithm.teacher
    return algorithm if teacher is None else distilled(algorithm, teacher.kl_coef, teacher.reward_coef)


def _group_algorithm(cfg) -> Algorithm:
    name = cfg.algorithm.name
    if name in ("grpo", "dapo"):
        overlong = cfg.algorithm.overlong
        return GroupAlgorithm(
            normalize_std=cfg.algorithm.normalize_std,
            dynamic_sampling=cfg.dynamic_sampling,
            overlong_filter=overlong.filter,
            overlong_penalty=overlong.penalty,
            max_length=overlong.max_length or cfg.worker.sampling.max_tokens,
            buffer_length=overlong.buffer_length,
            penalty_factor=overlong.penalty_factor,
        )
    from services.controller.tasks.rewards import import_object

    fn = import_object(name)
    if not callable(fn):
        raise ValueError(f"algorithm {name!r} is not callable")
    return fn
