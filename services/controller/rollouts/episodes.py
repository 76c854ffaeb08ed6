"""Agent sessions as the controller sees them, and the episodes rebuilt from them.

An external agent (code written against the `openai` SDK only) reaches a
rollout replica through a *session*: an OpenAI base URL scoped to one
episode, whose every model call the replica records token-exact: prompt ids,
completion ids, one log-prob per completion token, and the weight versions of
the first and last token. `rebuild` turns a session's calls (each a `Generation` the replica served)
into what the
trainer sees, from those ids alone. Text is never tokenized again: a
conversation re-tokenized from its text can differ from the ids that were
sampled, and the loss must see exactly the sampled tokens.

Segments. Calls are merged, in order, while each call's prompt starts with
the previous call's context (that call's prompt ids + completion ids); the
rollout splices a conversation sent back unchanged so that this holds, and a
usual multi-turn agent makes one segment. The ids between that context and
the new completion (tool results, new user text, chat-template glue) get
loss mask 0 and log-prob 0.0; the model's own tokens get mask 1 and their
log-probs. A call whose prompt does not extend the context (the agent
rewrote or summarised its history, or ran a sub-agent) starts a new segment.

What is trained. The batch machinery expects exactly `group_size`
trajectories per task, one per episode, so an episode of several segments
trains on its *last* one, which holds the final answer the reward judges;
the earlier ones are dropped and counted (`Episode.dropped_segments`).
Staleness is measured from the oldest turn of the trained segment
(`Trajectory.version` is the least of its turns' start versions).

A call that finished with "abort" (a weight update in ABORT mode, a replica
shutting down) makes the episode worth retrying; one that finished with
"error" fails it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.common.kept import KeptSet, check_kept, shifted as shifted_kept
from flywheel.common.provenance import VersionSpan, check_spans, merged, shifted
from flywheel.errors import Aborted
from services.controller.rollouts.routing import episode_routing
from services.controller.domain import RAW, FinishReason, Generation, SampledDistribution, Task, Trajectory


@dataclass(frozen=True)
class OpenedSession:
    """A session the controller opened for one episode."""

    id: str
    #: The agent's API key: valid only under this session's base URL.
    key: str
    #: The agent's OpenAI base URL ("http://host:port/sessions/<id>/v1").
    base_url: str
    #: Seconds until the replica forgets the session.
    expires_in: float


@dataclass(frozen=True)
class SessionRecord:
    """What a session holds when the controller reads it back."""

    id: str
    #: "open" | "finished" (the agent posted `finish`).
    state: str
    #: The reward the agent posted with `finish`, if any.
    reward: float | None
    calls: list[Generation]


class SessionLost(Aborted):
    """The session's records are gone (the replica restarted, or the session expired); the
    task is retried (an `Aborted`, like any generation a replica could not finish)."""


@dataclass
class Segment:
    """Consecutive calls each extending the previous one's context: one token sequence."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    #: Behaviour log-prob per response token (0.0 where the mask is 0).
    response_logprobs: list[float] = field(default_factory=list)
    #: 1 for the model's tokens, 0 for everything the agent put between them.
    response_mask: list[int] = field(default_factory=list)
    #: (version_start, version_end) of each call, in order.
    turn_versions: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.STOP
    #: The text of the segment's last completion: the episode's final answer.
    final_text: str = ""
    #: The distribution its calls sampled from (one for all: the trainer replays one per sequence).
    distribution: SampledDistribution | None = None
    #: The version of each model token, as spans over `response_ids` (the calls' own, moved to where
    #: their completions lie; a call without spans leaves its tokens uncovered).
    version_spans: list[VersionSpan] = field(default_factory=list)
    #: The calls' kept sets, moved to where their completions lie (flywheel.common.kept).
    kept_sets: list[KeptSet] = field(default_factory=list)
    #: Each call's prompt length and routing record, for the segment's routing (rollouts/routing.py).
    routing: list[tuple[int, Any]] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        """Every id so far: what the next call's prompt must start with to join this segment."""
        return self.prompt_ids + self.response_ids

    def extends(self, call: Generation) -> bool:
        context = self.context
        return list(call.prompt_token_ids[: len(context)]) == context

    def add(self, call: Generation) -> None:
        """Appends a call that extends this segment: the new prompt ids masked out, the completion in."""
        glue = list(call.prompt_token_ids[len(self.context):])
        self.response_ids += glue
        self.response_logprobs += [0.0] * len(glue)
        self.response_mask += [0] * len(glue)
        self._complete(call)

    def _complete(self, call: Generation) -> None:
        if self.distribution is not None and call.distribution != self.distribution:
            raise ValueError(f"a call sampled from {call.distribution} continues one sampled from {self.distribution}; "
                             "the trainer replays one distribution per sequence")
        self.distribution = call.distribution
        if call.version_spans:
            check_spans(call.version_spans, len(call.completion_token_ids), "version_spans")
            self.version_spans += shifted(call.version_spans, len(self.response_ids))
        check_kept(call.kept_sets, call.completion_token_ids)
        self.kept_sets += shifted_kept(call.kept_sets, len(self.response_ids))
        self.routing.append((len(call.prompt_token_ids), call.routed_experts))
        self.response_ids += call.completion_token_ids
        self.response_logprobs += [float(lp) for lp in call.completion_logprobs]
        self.response_mask += [1] * len(call.completion_token_ids)
        self.turn_versions.append((call.version_start, call.version_end))
        self.finish_reason = call.finish_reason
        self.final_text = call.text

    @classmethod
    def start(cls, call: Generation) -> Segment:
        segment = cls(prompt_ids=list(call.prompt_token_ids))
        segment._complete(call)
        return segment


@dataclass
class Episode:
    """A session's calls as segments, and whether they can be trained on."""

    segments: list[Segment]
    #: A call was aborted: the episode should be run again.
    aborted: bool = False
    #: The engine reported an error for a call: the episode failed.
    failed: bool = False

    @property
    def trained(self) -> Segment | None:
        """The segment that is trained: the last (None when the agent never called the model)."""
        return self.segments[-1] if self.segments else None

    @property
    def dropped_segments(self) -> int:
        return max(0, len(self.segments) - 1)


def rebuild(calls: Sequence[Generation]) -> Episode:
    """The episode of a session's calls, in call order; ValueError for a malformed call."""
    segments: list[Segment] = []
    for i, call in enumerate(calls):
        if len(call.completion_logprobs) != len(call.completion_token_ids):
            raise ValueError(
                f"call {i}: {len(call.completion_logprobs)} log-probs for {len(call.completion_token_ids)} completion tokens"
            )
        if call.distribution.penalised:
            raise ValueError(f"call {i}: sampled with a repetition penalty or min_tokens, which the trainer does not "
                             "replay (its log-probs would not match the trainer's)")
        if segments and segments[-1].extends(call):
            segments[-1].add(call)
        else:
            segments.append(Segment.start(call))
    return Episode(
        segments,
        aborted=any(c.finish_reason == FinishReason.ABORT for c in calls),
        failed=any(c.finish_reason == FinishReason.ERROR for c in calls),
    )


def trajectory(segment: Segment, task: Task, *, sample_index: int, model_tag: str, engine: str) -> Trajectory:
    """The trajectory of a segment (unscored)."""
    return Trajectory(
        task=task,
        prompt_ids=list(segment.prompt_ids),
        response_ids=list(segment.response_ids),
        response_logprobs=list(segment.response_logprobs),
        response_mask=list(segment.response_mask),
        version_start=min(start for start, _ in segment.turn_versions),
        version_end=max(end for _, end in segment.turn_versions),
        turn_versions=list(segment.turn_versions),
        finish_reason=segment.finish_reason,
        text=segment.final_text,
        sample_index=sample_index,
        model_tag=model_tag,
        keys={"turns": len(segment.turn_versions)},
        engine=engine,
        distribution=segment.distribution or RAW,
        version_spans=merged(segment.version_spans),
        kept_sets=list(segment.kept_sets),
        routed_experts=episode_routing(segment.routing),
    )
