"""GRPO / DAPO processing against hand-computed values, and the tensors of a batch."""

from __future__ import annotations

import math

import pytest
import torch

from services.controller.batches.algorithms import GroupAlgorithm, all_equal, grpo_advantages, make_algorithm, overlong_penalty
from services.controller.batches.batching import build_train_batch
from services.controller.domain import FinishReason
from tests.unit.controller.controller_helpers import config, task, trajectory


def test_grpo_advantages_by_hand() -> None:
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.57735
    adv = grpo_advantages([1, 0, 0, 1])
    assert adv == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-5)
    # mean 2; deviations -1, 0, 3, -2; std = sqrt((1 + 0 + 9 + 4) / 3) = 2.1602469
    assert grpo_advantages([1, 2, 5, 0]) == pytest.approx([-0.4629100, 0.0, 1.3887301, -0.9258201], abs=1e-5)
    assert grpo_advantages([1, 2, 5, 0], normalize_std=False) == [-1.0, 0.0, 3.0, -2.0]
    assert grpo_advantages([0.3, 0.3]) == [0.0, 0.0]
    assert grpo_advantages([7.0]) == [0.0]
    assert grpo_advantages([]) == []


def test_overlong_penalty_by_hand() -> None:
    # max 100, buffer 20: free up to 80, then linear to -1 at 100, -1 beyond.
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(90, 100, 20) == -0.5
    assert overlong_penalty(100, 100, 20) == -1.0
    assert overlong_penalty(130, 100, 20, factor=0.5) == -0.5


def test_group_algorithm_sets_advantages() -> None:
    group = [trajectory(task(1), r, index=i) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    assert GroupAlgorithm()(group) is None
    assert [t.advantage for t in group] == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-5)


def test_dynamic_sampling_drops_groups_with_equal_rewards() -> None:
    dapo = GroupAlgorithm(dynamic_sampling=True)
    assert dapo([trajectory(task(1), 1.0), trajectory(task(1), 1.0)]) == "equal_rewards"
    assert dapo([trajectory(task(1), 0.0), trajectory(task(1), 0.0)]) == "equal_rewards"
    assert dapo([trajectory(task(1), 0.0), trajectory(task(1), 1.0)]) is None
    assert GroupAlgorithm()([trajectory(task(1), 1.0), trajectory(task(1), 1.0)]) is None  # GRPO keeps them
    assert all_equal([0.5, 0.5 + 1e-12]) and not all_equal([0.5, 0.6])


def test_overlong_penalty_shapes_rewards_before_the_advantages() -> None:
    algo = GroupAlgorithm(overlong_penalty=True, max_length=10, buffer_length=4)
    short, long_ = trajectory(task(1), 1.0, response=6), trajectory(task(1), 1.0, response=8)
    assert algo([short, long_]) is None
    assert short.reward == 1.0 and long_.reward == pytest.approx(0.5)  # 8 tokens: (6 - 8) / 4 = -0.5
    assert long_.scores["overlong_penalty"] == pytest.approx(-0.5)
    assert short.advantage > 0 > long_.advantage


def test_overlong_filter_masks_truncated_completions_out_of_the_loss() -> None:
    algo = GroupAlgorithm(overlong_filter=True)
    cut = trajectory(task(1), 0.0, finish=FinishReason.LENGTH)
    ok = trajectory(task(1), 1.0)
    assert algo([cut, ok]) is None
    assert cut.response_mask == [0, 0, 0] and ok.response_mask == [1, 1, 1]
    assert cut.advantage is not None  # it still counted for the baseline
    assert algo([trajectory(task(2), 0.0, finish=FinishReason.LENGTH), trajectory(task(2), 1.0, finish=FinishReason.LENGTH)]) == "all_overlong"


def test_algorithms_by_name_and_plugged_in() -> None:
    assert make_algorithm(config(algorithm={"name": "dapo"})).dynamic_sampling
    assert not make_algorithm(config()).dynamic_sampling
    plugged = make_algorithm(config(algorithm={"name": "tests.unit.controller.test_controller_algorithms:constant_advantage"}))
    group = [trajectory(task(1), 0.0)]
    assert plugged(group) is None and group[0].advantage == 1.0


def constant_advantage(group):
    for t in group:
        t.advantage = 1.0
    return None


def test_batch_tensors_follow_the_trainer_contract() -> None:
    a = trajectory(task(1), response=2)
    a.advantage = 0.5
    b = trajectory(task(2), response=4, version=3)
    b.response_mask = [1, 0, 0, 1]  # tool tokens in the middle
    b.response_logprobs = [-0.1, -9.0, -9.0, -0.4]
    b.advantage = -1.0
    batch = build_train_batch([a, b], target_version=4)
    t = batch.tensors
    assert t["input_ids"].shape == (2, 7) and t["input_ids"].dtype == torch.int64
    assert t["input_ids"][0].tolist() == [5, 6, 7, 10, 11, 0, 0]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [1] * 7]
    assert t["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0, 1]]
    lp = t["behaviour_logprobs"]
    assert lp.dtype == torch.float32 and lp[1].tolist() == pytest.approx([0, 0, 0, -0.1, 0, 0, -0.4])
    assert t["advantages"].tolist() == [0.5, -1.0]
    # Per token, where the policy made one (tool tokens and the prompt: 0).
    assert t["weight_versions"].tolist() == [[0] * 7, [0, 0, 0, 3, 0, 0, 3]]
    assert batch.staleness() == [4, 1] and batch.tokens == 12
    assert math.isclose(float(t["loss_mask"].sum()), 4.0)
    # Raw log-probs everywhere: nothing for the trainer to replay, no sampling fields.
    assert not any(name.startswith("sampling_") for name in t)


def test_a_batch_carries_the_distribution_each_sample_was_drawn_from() -> None:
    from services.controller.domain import SampledDistribution

    a, b = trajectory(task(1), response=2), trajectory(task(2), response=3)
    a.distribution = SampledDistribution(temperature=0.7, top_p=0.8)
    b.distribution = SampledDistribution(temperature=0.5, top_k=20)
    t = build_train_batch([a, b], target_version=1).tensors
    assert t["sampling_temperature"].tolist() == pytest.approx([0.7, 0.5])
    assert t["sampling_top_k"].tolist() == [0, 20] and t["sampling_top_k"].dtype == torch.int64
    assert t["sampling_top_p"].tolist() == pytest.approx([0.8, 1.0])
    b.distribution = SampledDistribution(temperature=0.7, penalised=True)
    with pytest.raises(ValueError, match="repetition penalty"):
        build_train_batch([a, b], target_version=1)
