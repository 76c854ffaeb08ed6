"""Batch validation: every malformed field is rejected with a message naming it."""

from __future__ import annotations

import pytest
import torch

from flywheel.errors import FailedPrecondition, InvalidArgument
from services.trainer.batch import MIN_SHARED_PREFIX, Batch, BatchLimits, MicroBatch, input_batch, training_batch

LIMITS = BatchLimits(max_batch_tokens=64, max_sequence_length=16, vocab_size=100)


def good(**overrides):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    tensors = {
        "input_ids": ids,
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
        "loss_mask": torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "behaviour_logprobs": torch.tensor([[0.0, 0.0, -1.0, -2.0], [0.0, -0.5, -0.5, 0.0]]),
        "weight_versions": torch.tensor([3, 4]),
    }
    tensors.update(overrides)
    return tensors


def build(**overrides):
    return training_batch(good(**overrides), LIMITS, weight_version=4, needs_behaviour=True)


def test_a_good_batch_is_normalised() -> None:
    batch = build(loss_mask=torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool))
    assert batch.loss_mask.dtype == torch.float32
    assert batch.advantages.shape == (2, 4)  # per-sequence advantages broadcast to tokens
    assert batch.advantages[1].tolist() == [-1.0] * 4
    assert batch.real_tokens == 7
    assert batch.rows(1, 2).input_ids.tolist() == [[9, 10, 11, 0]]


def test_per_token_advantages_are_accepted() -> None:
    adv = torch.arange(8, dtype=torch.float32).view(2, 4)
    assert torch.equal(build(advantages=adv).advantages, adv)


def test_missing_attention_mask_means_all_real() -> None:
    batch = input_batch({"input_ids": torch.tensor([[1, 2, 3]])}, LIMITS)
    assert batch.attention_mask.tolist() == [[1, 1, 1]]


def test_values_outside_the_loss_mask_are_zeroed() -> None:
    behaviour = torch.tensor([[float("nan"), 0.0, -1.0, -2.0], [0.0, -0.5, -0.5, float("inf")]])
    batch = build(behaviour_logprobs=behaviour)
    assert torch.isfinite(batch.behaviour_logprobs).all()


@pytest.mark.parametrize(
    ("overrides", "field", "error"),
    [
        ({"input_ids": None}, "batch.input_ids: missing", InvalidArgument),
        ({"input_ids": torch.zeros(0, 4, dtype=torch.int64)}, "batch.input_ids: the batch is empty", InvalidArgument),
        ({"input_ids": torch.tensor([[1], [2]])}, "batch.input_ids: sequences need at least 2", InvalidArgument),
        ({"input_ids": torch.tensor([[5.0, 6.0, 7.0, 8.0]] * 2)}, "batch.input_ids: dtype float32", InvalidArgument),
        ({"input_ids": torch.tensor([5, 6, 7, 8])}, "batch.input_ids: must be 2-D", InvalidArgument),
        ({"input_ids": torch.tensor([[5, 6, 7, 100], [1, 2, 3, 0]])}, "batch.input_ids: ids outside", InvalidArgument),
        ({"attention_mask": torch.ones(2, 3, dtype=torch.int64)}, "batch.attention_mask: shape [2, 3]", InvalidArgument),
        ({"attention_mask": torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0]])}, "batch.attention_mask: must be right-padded", InvalidArgument),
        ({"attention_mask": torch.tensor([[1, 1, 1, 2], [1, 1, 1, 0]])}, "batch.attention_mask: values must be 0 or 1", InvalidArgument),
        ({"loss_mask": None}, "batch.loss_mask: missing", InvalidArgument),
        ({"loss_mask": torch.ones(2, 5)}, "batch.loss_mask: shape [2, 5] does not match input_ids [2, 4]", InvalidArgument),
        ({"loss_mask": torch.tensor([[0.0, 0, 1, 1], [0, 1, 1, 1]])}, "batch.loss_mask: selects padding", InvalidArgument),
        ({"loss_mask": torch.tensor([[1.0, 0, 1, 1], [0, 1, 1, 0]])}, "batch.loss_mask: position 0", InvalidArgument),
        ({"loss_mask": torch.zeros(2, 4)}, "batch.loss_mask: selects no tokens", InvalidArgument),
        ({"loss_mask": torch.full((2, 4), 2.0)}, "batch.loss_mask: values must lie in", InvalidArgument),
        ({"advantages": None}, "batch.advantages: missing", InvalidArgument),
        ({"advantages": torch.tensor([1.0, float("nan")])}, "batch.advantages: NaN or inf", InvalidArgument),
        ({"advantages": torch.tensor([1.0, float("inf")])}, "batch.advantages: NaN or inf", InvalidArgument),
        ({"advantages": torch.tensor([1.0, 2.0, 3.0])}, "batch.advantages: shape [3]", InvalidArgument),
        ({"advantages": torch.tensor([1, 2])}, "batch.advantages: dtype int64", InvalidArgument),
        ({"behaviour_logprobs": None}, "batch.behaviour_logprobs: missing", InvalidArgument),
        ({"behaviour_logprobs": torch.zeros(2, 3)}, "batch.behaviour_logprobs: shape", InvalidArgument),
        ({"behaviour_logprobs": torch.full((2, 4), float("nan"))}, "batch.behaviour_logprobs: NaN", InvalidArgument),
        ({"behaviour_logprobs": torch.full((2, 4), 0.5)}, "batch.behaviour_logprobs: log-probs must be <= 0", InvalidArgument),
        ({"old_logprobs": torch.full((2, 4), float("-inf"))}, "batch.old_logprobs: NaN or inf", InvalidArgument),
        ({"weight_versions": torch.tensor([1, 2, 3])}, "batch.weight_versions: shape", InvalidArgument),
        ({"weight_versions": torch.tensor([-1, 2])}, "batch.weight_versions: must be >= 0", InvalidArgument),
        ({"weight_versions": torch.tensor([4, 5])}, "batch.weight_versions: tokens from version 5", FailedPrecondition),
        ({"weight_versions": torch.tensor([[0, 0, 4, 5], [0, 4, 4, 0]])}, "batch.weight_versions: tokens from version 5",
         FailedPrecondition),
        ({"weight_versions": torch.zeros(2, 3, dtype=torch.int64)}, "batch.weight_versions: shape [2, 3] is neither",
         InvalidArgument),
    ],
)
def test_bad_fields_are_named(overrides, field: str, error: type) -> None:
    with pytest.raises(error) as info:
        build(**overrides)
    assert str(info.value).startswith(field), str(info.value)
    assert type(info.value) is error


def test_per_token_versions_are_read_where_the_loss_reads() -> None:
    # A version newer than the trainer's outside the loss mask (a prompt or padding position) is never read.
    batch = build(weight_versions=torch.tensor([[9, 9, 2, 4], [9, 3, 4, 9]]))
    assert batch.weight_versions.shape == (2, 4)


def test_size_limits() -> None:
    long = torch.ones(1, 17, dtype=torch.int64)
    with pytest.raises(InvalidArgument, match="max_sequence_length"):
        input_batch({"input_ids": long}, LIMITS)
    many = torch.ones(5, 16, dtype=torch.int64)
    with pytest.raises(InvalidArgument, match=r"batch.input_ids: 5x16 = 80 tokens exceeds limits.max_batch_tokens = 64"):
        input_batch({"input_ids": many}, LIMITS)


def test_behaviour_logprobs_are_optional_when_not_needed() -> None:
    batch = training_batch(good(behaviour_logprobs=None, old_logprobs=torch.zeros(2, 4)), LIMITS,
                           weight_version=4, needs_behaviour=False)
    assert batch.behaviour_logprobs is None and batch.old_logprobs is not None


def test_rows_of_one_prompt_are_planned_together_and_the_rest_by_length() -> None:
    p = MIN_SHARED_PREFIX  # prompt lengths: p for questions A and B, p + 2 for the row alone
    rows = [  # (prompt, total length)
        ("A", p, p + 3), ("B", p, p + 2), ("A", p, p + 6), ("alone", p + 2, p + 4), ("B", p, p + 5),
        ("A", p, p + 4), ("short", 2, 6), ("A", p, p + 5),
    ]
    width = p + 6
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    loss = torch.zeros(len(rows), width)
    for i, (name, prompt, length) in enumerate(rows):
        ids[i, :prompt] = 10 + ord(name[0])  # the same prompt tokens for the same question
        ids[i, prompt:length] = 100 + i
        mask[i, :length] = 1
        loss[i, prompt:length] = 1.0
    batch = Batch(input_ids=ids, attention_mask=mask, loss_mask=loss)
    planned, order, plans = batch.planned(micro=3)
    # A's four rows longest first, cut at 3; B's two; then the rest (a one-row group, a prompt too
    # short to share) longest first.
    assert order.tolist() == [2, 7, 5, 0, 4, 1, 3, 6]
    assert plans == [MicroBatch(0, 3, p), MicroBatch(3, 4, 0), MicroBatch(4, 6, p), MicroBatch(6, 8, 0)]
    assert torch.equal(planned.input_ids, ids[order]) and torch.equal(planned.loss_mask, loss[order])
    # No loss mask (ComputeLogprobs): nothing is known to be a prompt.
    _, _, plans = Batch(input_ids=ids, attention_mask=mask).planned(micro=8)
    assert [plan.shared_prefix for plan in plans] == [0]
