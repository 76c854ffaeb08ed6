"""The teacher of on-policy distillation: its log-probs of the tokens the student sampled.

Once a group is generated (and its reward scored), `Teacher.score_group` sends
every trajectory's prompt + response ids to the teacher in one Score call (a
prefill on a rollout replica serving the teacher model: nothing is sampled)
and keeps, per response token, the teacher's log-prob of it
(`Trajectory.teacher_logprobs`, 0 where the token is not the policy's). The
algorithm turns them into per-token advantages (`batches.algorithms.distilled`).

A call has a deadline (`timeout_seconds`); a failed or late call is retried on
the next teacher address after a doubling backoff, `max_attempts` calls in
all. A group the teacher could not score fails, its trajectories carrying the
reason: it is counted and given up, never trained without the teacher (its
advantages would be made up). After `max_consecutive_failures` such groups in a
row the run is told with a critical error, and its error policy decides.

The transport (`Score`) is an adapter (services/controller/adapters/teacher_grpc.py
over gRPC); tests pass a simulated one.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from services.controller.domain import Trajectory, TrajectoryStatus
from services.controller.run_config import TeacherConfig
from services.controller.telemetry.errors_report import ErrorReporter

#: Scores sequences on the teacher (its `attempt`-th call, from 0): per sequence, log p(ids[i + 1] | ids[:i + 1])
#: for each i (len(ids) - 1 of them); raises on a failed call.
Score = Callable[[Sequence[Sequence[int]], int], Awaitable[list[list[float]]]]

#: The counters a teacher keeps (`teacher/<name>_total` in metrics.jsonl, every step, zeros included).
COUNTERS = ("calls", "scored", "failed", "retries", "timeouts")


class TeacherFailed(Exception):
    """Every call for one group failed; the message says why the last one did."""


class Teacher:
    def __init__(self, config: TeacherConfig, score: Score, errors: ErrorReporter | None = None) -> None:
        self.config, self._score, self.errors = config, score, errors
        self.counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._consecutive_failures = 0
        #: Since the last step's metrics: the policy tokens scored, and their summed sampling - teacher
        #: log-prob (the per-token reverse KL's estimate).
        self._tokens = 0
        self._reverse_kl = 0.0

    async def score_group(self, trajectories: list[Trajectory]) -> str | None:
        """Sets every trajectory's `teacher_logprobs`; on failure marks them all FAILED and returns why."""
        try:
            scores = await self._call([t.prompt_ids + t.response_ids for t in trajectories])
            for t, logprobs in zip(trajectories, scores, strict=True):
                t.teacher_logprobs = self._of_response(t, logprobs)
        except TeacherFailed as exc:
            self.counts["failed"] += 1
            self._consecutive_failures += 1
            reason = f"teacher: {exc}"
            for t in trajectories:
                t.status, t.error, t.teacher_logprobs = TrajectoryStatus.FAILED, reason, None
            if self.errors is not None and self._consecutive_failures == self.config.max_consecutive_failures:
                self.errors.report(
                    "teacher", f"the teacher could not score {self._consecutive_failures} groups in a row "
                    f"(algorithm.teacher.max_consecutive_failures); the last: {exc}", severity="critical")
            return reason
        self.counts["scored"] += 1
        self._consecutive_failures = 0
        for t in trajectories:
            assert t.teacher_logprobs is not None
            for teacher, sampled, mask in zip(t.teacher_logprobs, t.response_logprobs, t.response_mask):
                if mask:
                    self._tokens += 1
                    self._reverse_kl += sampled - teacher
        return None

    async def _call(self, sequences: list[list[int]]) -> list[list[float]]:
        cfg = self.config
        backoff, last = cfg.retry_backoff_seconds, "no call made"
        for attempt in range(cfg.max_attempts):
            if attempt:
                self.counts["retries"] += 1
                await asyncio.sleep(backoff)
                backoff *= 2
            self.counts["calls"] += 1
            try:
                scores = await asyncio.wait_for(self._score(sequences, attempt), cfg.timeout_seconds)
            except TimeoutError:
                self.counts["timeouts"] += 1
                last = f"no answer within {cfg.timeout_seconds:g} s (algorithm.teacher.timeout_seconds)"
                continue
            except Exception as exc:  # noqa: BLE001 - every failed call is retried, then reported
                last = f"{type(exc).__name__}: {exc}"
                continue
            if len(scores) != len(sequences):
                last = f"{len(scores)} scores for {len(sequences)} sequences"
                continue
            return scores
        raise TeacherFailed(f"{cfg.max_attempts} call(s) failed; the last: {last}")

    @staticmethod
    def _of_response(t: Trajectory, logprobs: list[float]) -> list[float]:
        """The teacher's log-prob of each response token (0 where it is not the policy's)."""
        p, r = len(t.prompt_ids), len(t.response_ids)
        if len(logprobs) != p + r - 1:
            raise TeacherFailed(f"the teacher returned {len(logprobs)} log-probs for a sequence of {p + r} tokens")
        response = logprobs[p - 1:]
        if any(not math.isfinite(x) for x, mask in zip(response, t.response_mask) if mask):
            raise TeacherFailed("the teacher returned a log-prob that is not finite")
        return [x if mask else 0.0 for x, mask in zip(response, t.response_mask)]

    def metrics(self) -> dict[str, float]:
        """Counters (teacher/<name>_total) and, over the policy tokens scored since the last call, the mean
        per-token reverse KL to the teacher (sampling log-prob - teacher's: teacher/reverse_kl)."""
        m = {f"teacher/{name}_total": float(n) for name, n in self.counts.items()}
        if self._tokens:
            m["teacher/reverse_kl"] = self._reverse_kl / self._tokens
            m["teacher/tokens"] = float(self._tokens)
        self._tokens, self._reverse_kl = 0, 0.0
        return m
