"""One multi-turn episode's tokens as they were made: what the agent and environment workers build
their trajectories from.

The model's turns join with their log-probs, loss mask 1, the versions and kept sets the replica
recorded; what the world answers (tool results, an environment's observations) joins with mask 0 and
log-prob 0.0, so it never enters the loss. Everything is token ids from the start (the prompt
tokenized once by the engine's chat template, each turn generated from prompt + everything so far):
what is trained is exactly what was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flywheel.common.kept import KeptSet, shifted as shifted_kept
from flywheel.common.provenance import VersionSpan, shifted
from services.controller.domain import FinishReason, Generation, RolloutOutcome, RolloutStatus, Task, Trajectory
from services.controller.rollouts.routing import episode_routing


class EpisodeStopped(Exception):
    """A turn's generation ended the episode's rollout: `outcome` (aborted: retried; an engine error: failed)."""

    def __init__(self, outcome: RolloutOutcome) -> None:
        super().__init__(outcome.error)
        self.outcome = outcome


@dataclass
class Transcript:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    kept: list[KeptSet] = field(default_factory=list)
    routing: list[tuple[int, Any]] = field(default_factory=list)
    finish: FinishReason = FinishReason.STOP
    last: Generation | None = None

    @property
    def context(self) -> list[int]:
        """What the next turn generates from."""
        return self.prompt_ids + self.ids

    def model_turn(self, g: Generation) -> None:
        """Adds a generated turn; raises EpisodeStopped for an aborted or failed generation."""
        if g.finish_reason == FinishReason.ABORT:
            raise EpisodeStopped(RolloutOutcome(RolloutStatus.RE_ROLLOUT, error="generation aborted"))
        if g.finish_reason == FinishReason.ERROR:
            raise EpisodeStopped(RolloutOutcome(RolloutStatus.FAIL, error="the engine reported an error for a generation"))
        self.starts.append(g.version_start)
        self.ends.append(g.version_end)
        self.spans += shifted(g.version_spans, len(self.ids))
        self.kept += shifted_kept(g.kept_sets, len(self.ids))
        self.routing.append((len(g.prompt_token_ids), g.routed_experts))
        self.ids += g.completion_token_ids
        self.logprobs += g.completion_logprobs
        self.mask += [1] * len(g.completion_token_ids)
        self.texts.append(g.text)
        self.finish, self.last = g.finish_reason, g

    def world_turn(self, ids: list[int], text: str) -> None:
        """Adds what the world answered (a tool's result, an environment's observation): never trained."""
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.texts.append(text)

    def trajectory(self, task: Task, index: int, model_tag: str, **fields: Any) -> Trajectory:
        """The episode as the trainer sees it (`fields`: more of the Trajectory's, e.g. its reward)."""
        g = self.last
        assert g is not None, "an episode has at least one model turn"
        return Trajectory(
            task=task, prompt_ids=self.prompt_ids, response_ids=self.ids, response_logprobs=self.logprobs,
            response_mask=self.mask, version_start=min(self.starts), version_end=max(self.ends),
            turn_versions=list(zip(self.starts, self.ends)), finish_reason=self.finish, text="".join(self.texts),
            sample_index=index, model_tag=model_tag, keys={"turns": len(self.starts)}, engine=g.engine,
            distribution=g.distribution, version_spans=self.spans, kept_sets=self.kept,
            routed_experts=episode_routing(self.routing), **fields,
        )
