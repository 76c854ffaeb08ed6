"""Episodes rebuilt from a session's recorded calls: from token ids only."""

from __future__ import annotations

import pytest

from services.controller.domain import FinishReason, Generation
from services.controller.rollouts.episodes import rebuild, trajectory
from tests.unit.controller.controller_helpers import task


def call(prompt, completion, *, versions=(1, 1), finish=FinishReason.STOP, text="", logprobs=None) -> Generation:
    return Generation(
        prompt_token_ids=list(prompt), completion_token_ids=list(completion),
        completion_logprobs=list(logprobs) if logprobs is not None else [-0.1 * (i + 1) for i in range(len(completion))],
        version_start=versions[0], version_end=versions[1], finish_reason=finish, engine="r0", text=text,
    )


def test_turns_that_extend_the_context_merge_into_one_segment() -> None:
    first = call([1, 2, 3], [10, 11], logprobs=[-1.0, -2.0], text="calling the tool")
    # The agent sent the conversation back unchanged, plus a tool result [20, 21] and template glue [22].
    second = call([1, 2, 3, 10, 11, 20, 21, 22], [12, 13, 14], logprobs=[-3.0, -4.0, -5.0], text="33")
    episode = rebuild([first, second])
    assert len(episode.segments) == 1 and episode.dropped_segments == 0
    segment = episode.trained
    assert segment.prompt_ids == [1, 2, 3]
    assert segment.response_ids == [10, 11, 20, 21, 22, 12, 13, 14]
    assert segment.response_mask == [1, 1, 0, 0, 0, 1, 1, 1]
    assert segment.response_logprobs == [-1.0, -2.0, 0.0, 0.0, 0.0, -3.0, -4.0, -5.0]
    assert segment.final_text == "33" and segment.finish_reason == FinishReason.STOP


def test_a_prompt_that_does_not_extend_the_context_starts_a_new_segment() -> None:
    first = call([1, 2, 3], [10, 11], text="ab")
    # Same text as "prompt + 'ab'", but tokenized differently ([12] where the model sampled [10, 11]):
    # the ids decide, so this is a new segment and nothing is spliced across it.
    second = call([1, 2, 3, 12, 20], [30], text="done")
    third = call([1, 2, 3, 12, 20, 30, 21], [31, 32], text="final")
    episode = rebuild([first, second, third])
    assert [s.prompt_ids for s in episode.segments] == [[1, 2, 3], [1, 2, 3, 12, 20]]
    assert episode.dropped_segments == 1
    trained = episode.trained
    assert trained.response_ids == [30, 21, 31, 32] and trained.response_mask == [1, 0, 1, 1]
    assert trained.final_text == "final"


def test_a_call_sharing_only_part_of_the_context_is_not_merged() -> None:
    # The agent trimmed the previous completion: its prompt is a strict prefix of the context, not an extension.
    episode = rebuild([call([1, 2], [10, 11, 12]), call([1, 2, 10, 11], [13])])
    assert len(episode.segments) == 2 and episode.trained.prompt_ids == [1, 2, 10, 11]


def test_mask_and_logprobs_stay_aligned_with_the_ids() -> None:
    calls = [call([5], [6, 7]), call([5, 6, 7, 8], [9]), call([5, 6, 7, 8, 9], [4, 3])]  # the last adds no glue
    t = trajectory(rebuild(calls).trained, task(), sample_index=2, model_tag="m", engine="r0")
    assert len(t.response_ids) == len(t.response_mask) == len(t.response_logprobs) == 6
    assert t.response_mask == [1, 1, 0, 1, 1, 1]
    assert all(lp == 0.0 for lp, m in zip(t.response_logprobs, t.response_mask) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(t.response_logprobs, t.response_mask) if m == 1)
    assert t.prompt_ids + t.response_ids == [5, 6, 7, 8, 9, 4, 3]
    assert (t.sample_index, t.model_tag, t.engine, t.keys) == (2, "m", "r0", {"turns": 3})


def test_per_turn_versions_and_staleness_from_the_oldest_turn() -> None:
    calls = [call([1], [2], versions=(3, 3)), call([1, 2, 9], [4], versions=(3, 4)), call([1, 2, 9, 4, 9], [5], versions=(5, 5))]
    t = trajectory(rebuild(calls).trained, task(), sample_index=0, model_tag="default", engine="r0")
    assert t.turn_versions == [(3, 3), (3, 4), (5, 5)]
    assert (t.version_start, t.version_end) == (3, 5)
    assert t.version == 3  # staleness counts from the oldest policy that sampled a trained token
    # A dropped segment's versions do not count: only the trained segment's turns are kept.
    dropped_first = [call([7], [8], versions=(1, 1)), *calls]
    t = trajectory(rebuild(dropped_first).trained, task(), sample_index=0, model_tag="default", engine="r0")
    assert t.version == 3 and t.turn_versions == [(3, 3), (3, 4), (5, 5)]
    t.version_start = 4  # the property is the least over the turns, whatever version_start says
    assert t.version == 3


def test_aborted_or_failed_calls_mark_the_episode() -> None:
    assert rebuild([call([1], [2]), call([1, 2], [3], finish=FinishReason.ABORT)]).aborted
    failed = rebuild([call([1], [2], finish=FinishReason.ERROR)])
    assert failed.failed and not failed.aborted
    clean = rebuild([call([1], [2], finish=FinishReason.LENGTH)])
    assert not (clean.aborted or clean.failed) and clean.trained.finish_reason == FinishReason.LENGTH
    empty = rebuild([])
    assert empty.trained is None and empty.dropped_segments == 0


def test_a_call_with_a_logprob_missing_is_malformed() -> None:
    with pytest.raises(ValueError, match="call 1: 1 log-probs for 2 completion tokens"):
        rebuild([call([1], [2]), call([1, 2], [3, 4], logprobs=[-0.5])])


def test_a_segment_keeps_the_distribution_its_calls_sampled_from() -> None:
    from dataclasses import replace

    from services.controller.domain import SampledDistribution

    tempered = SampledDistribution(temperature=0.7, top_p=0.8)
    first = replace(call([1, 2], [10]), distribution=tempered)
    second = replace(call([1, 2, 10, 20], [11]), distribution=tempered)
    segment = rebuild([first, second]).trained
    assert trajectory(segment, task(), sample_index=0, model_tag="default", engine="r0").distribution == tempered
    # A continuation sampled differently cannot be one sequence the trainer replays under one distribution.
    with pytest.raises(ValueError, match="one distribution per sequence"):
        rebuild([first, replace(second, distribution=SampledDistribution(temperature=1.0))])
    # Penalties are not replayed: refused, not trained with mismatched log-probs.
    with pytest.raises(ValueError, match="repetition penalty"):
        rebuild([replace(first, distribution=SampledDistribution(temperature=0.7, penalised=True))])


def test_each_calls_token_versions_land_where_its_completion_lies_in_the_trajectory() -> None:
    from flywheel.common.provenance import VersionSpan
    from services.controller.adapters.sessions import session_call

    # A session record as the rollout writes it (its version_spans: [version, start, end]), then a second turn
    # made across an update from 3 to 4; the first turn's record predates spans (an older rollout).
    first = session_call({"prompt_token_ids": [1, 2], "completion_token_ids": [10, 11], "logprobs": [-1.0, -1.0],
                          "version_start": 2, "version_end": 2, "finish_reason": "stop", "version_spans": [[2, 0, 2]]})
    assert first.version_spans == [VersionSpan(2, 0, 2)]
    second = call([1, 2, 10, 11, 20], [12, 13, 14], versions=(3, 4))
    second.version_spans = [VersionSpan(3, 0, 1), VersionSpan(4, 1, 3)]
    t = trajectory(rebuild([first, second]).trained, task(), sample_index=0, model_tag="m", engine="r0")
    assert t.response_ids == [10, 11, 20, 12, 13, 14]
    assert t.version_spans == [VersionSpan(2, 0, 2), VersionSpan(3, 3, 4), VersionSpan(4, 4, 6)]
    assert t.token_versions() == [2, 2, 2, 3, 4, 4]  # the tool token (no span) counts as the oldest version

    bad = call([1, 2, 10, 11, 20], [12, 13, 14])
    bad.version_spans = [VersionSpan(3, 0, 2)]  # covers 2 of its 3 tokens
    with pytest.raises(ValueError, match="version_spans"):
        rebuild([first, bad])
