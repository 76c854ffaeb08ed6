"""Per-token provenance and a bound in every mode: a token older than the bound is masked (or
corrected) alone, its neighbours in the same sample train; in fully-async, a replica that returns
its samples many versions late has none of them trained past the bound uncorrected, and
metrics.jsonl counts what was masked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flywheel.common.provenance import VersionSpan, check_spans, spans_of, versions_of
from services.controller.batches.batching import TokenBound, build_train_batch, stale_everywhere
from services.controller.loop import run
from services.controller.telemetry.metrics_log import JsonlSink
from services.controller.testing.simulated import constant, run_virtual
from services.trainer.losses import LossSettings, policy_loss
from tests.unit.controller.controller_helpers import config, items, simulated_pipeline, task, trajectory


def test_spans_round_trip_and_refuse_what_does_not_cover_a_completion() -> None:
    versions = [2, 2, 2, 5, 5, 7]
    spans = spans_of(versions)
    assert spans == [VersionSpan(2, 0, 3), VersionSpan(5, 3, 5), VersionSpan(7, 5, 6)]
    assert versions_of(spans, 6) == versions and spans_of([]) == []
    for bad, length in (([VersionSpan(2, 0, 3)], 4), ([VersionSpan(2, 1, 3)], 3), ([VersionSpan(2, 0, 0)], 0)):
        with pytest.raises(ValueError):
            check_spans(bad, length)


def _mixed(version_spans: list[VersionSpan], response: int = 6):
    t = trajectory(task(1), response=response, version=version_spans[0].version)
    t.version_end = version_spans[-1].version
    t.version_spans = version_spans
    t.response_logprobs = [-0.1 * (i + 1) for i in range(response)]
    t.advantage = 1.0
    return t


def test_a_token_older_than_the_bound_is_masked_alone_while_its_neighbours_in_the_sample_train() -> None:
    # One sample made across two updates: 3 tokens of version 2, 3 of version 5; trained at version 6 with bound 2.
    t = _mixed([VersionSpan(2, 0, 3), VersionSpan(5, 3, 6)])
    fresh = trajectory(task(2), response=6, version=6)
    fresh.advantage = -1.0
    batch = build_train_batch([t, fresh], target_version=6, bound=TokenBound(2))
    mask, lp, versions = (batch.tensors[k][0].tolist() for k in ("loss_mask", "behaviour_logprobs", "weight_versions"))
    prompt = len(t.prompt_ids)
    assert versions[prompt:] == [2, 2, 2, 5, 5, 5]
    assert mask[prompt:] == [0, 0, 0, 1, 1, 1]  # the old tokens alone
    assert lp[prompt:] == pytest.approx([0, 0, 0, -0.4, -0.5, -0.6])
    assert batch.stale_tokens == 3 and not batch.stale_corrected
    assert batch.token_ages == {1: 3, 0: 6}  # what is trained: the young half of one sample, all of the other

    # The trainer's loss then takes no gradient from the masked tokens and a full one from their neighbours.
    logprobs = batch.tensors["behaviour_logprobs"].clone().requires_grad_(True)
    out = policy_loss(LossSettings(), logprobs=logprobs, mask=batch.tensors["loss_mask"],
                      advantages=batch.tensors["advantages"][:, None].expand_as(logprobs),
                      behaviour_logprobs=batch.tensors["behaviour_logprobs"])
    out.loss.backward()
    grad = logprobs.grad[0, prompt:].tolist()
    assert grad[:3] == [0, 0, 0] and all(g != 0 for g in grad[3:])

    # policy correct: the same tokens stay in the loss, for the trainer's IS correction, and are counted.
    corrected = build_train_batch([t, fresh], target_version=6, bound=TokenBound(2, correct=True))
    assert corrected.tensors["loss_mask"][0].tolist()[prompt:] == [1] * 6
    assert corrected.stale_tokens == 3 and corrected.stale_corrected
    assert corrected.token_ages == {4: 3, 1: 3, 0: 6}


def test_a_sample_without_spans_is_attributed_to_its_oldest_version_and_tool_tokens_stay_out() -> None:
    t = trajectory(task(1), response=4, version=3)
    t.version_end = 5  # ended on 5, but which token was whose is unknown: all count as 3's
    t.response_mask = [1, 0, 0, 1]
    assert t.token_versions() == [3, 3, 3, 3]
    batch = build_train_batch([t], target_version=6, bound=TokenBound(2))
    assert batch.stale_tokens == 2 and batch.tensors["loss_mask"].sum() == 0
    assert stale_everywhere([t], 6, TokenBound(2)) and not stale_everywhere([t], 5, TokenBound(2))
    assert not stale_everywhere([t], 6, TokenBound(2, correct=True)) and not stale_everywhere([t], 99, TokenBound())
    t.version_spans = [VersionSpan(3, 0, 1), VersionSpan(5, 3, 4)]  # tool tokens 1..2 fall between the spans
    assert t.token_versions() == [3, 3, 3, 5]
    assert not stale_everywhere([t], 6, TokenBound(2))


def _late_replica_run(tmp_path: Path, policy: str, seed: int = 0):
    """Fully-async, two replicas: one prompt, one that takes 40 train steps to return (a stalled host); it
    keeps taking the versions its other requests need, so its late samples' last tokens are young."""
    cfg = config(
        mode="fully-async", staleness={"policy": policy, "fully_async_bound": 2},
        worker={"group_size": 2, "max_in_flight": 8, "max_retries": 50},
        algorithm={"train_batch_size": 4}, data={"train": {"items": items(400)}},
        sync={"pause_mode": "keep"}, run={"max_steps": 30, "seed": seed},
    )
    p, trainer, engines = simulated_pipeline(cfg, seed=seed, gen_sigma=0, gen_mean=0.01, train_mean=0.05, replicas=2)
    engines[1].gen_time = constant(0.4)
    path = tmp_path / policy / "metrics.jsonl"
    p.metrics.add(JsonlSink(path))
    summary = run_virtual(run(p))
    assert summary.steps == 30, summary.stop_reason
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return p, trainer, engines, rows


def test_fully_async_trains_nothing_from_a_late_replica_past_the_bound_uncorrected(tmp_path: Path) -> None:
    p, trainer, engines, rows = _late_replica_run(tmp_path, "pace")
    late = [g for g in engines[1].generated if len(g.version_spans) > 1]
    assert late, "the late replica's samples should span updates"
    assert max(g.version_end - g.version_start for g in late) > 2  # many versions late
    assert all(v - token <= 2 for v, tokens in trainer.trained_tokens for token in tokens)
    masked = rows[-1]["staleness/masked_tokens_total"]
    assert masked > 0 and masked == sum(r["staleness/masked_tokens"] for r in rows)
    assert all(r["staleness/token_age_max"] <= 2 for r in rows)
    assert rows[-1]["staleness/corrected_tokens_total"] == 0

    # policy correct: the old tokens are trained, every one of them with the IS correction on (is_cap).
    p, trainer, _, rows = _late_replica_run(tmp_path, "correct")
    assert p.config.loss.is_cap > 0
    assert rows[-1]["staleness/masked_tokens_total"] == 0
    corrected = rows[-1]["staleness/corrected_tokens_total"]
    assert corrected > 0 and corrected == sum(
        n for r in rows for key, n in r.items() if key.startswith("staleness/token_age/") and int(key.rsplit("/", 1)[1]) > 2)


def test_the_per_token_versions_reach_the_trainer_as_one_row_per_sample() -> None:
    t = _mixed([VersionSpan(4, 0, 2), VersionSpan(5, 2, 6)])
    batch = build_train_batch([t], target_version=5)
    assert batch.tensors["weight_versions"].dtype == torch.int64
    assert batch.tensors["weight_versions"].shape == batch.tensors["input_ids"].shape
    assert batch.stale_tokens == 0 and batch.token_ages == {1: 2, 0: 4}
