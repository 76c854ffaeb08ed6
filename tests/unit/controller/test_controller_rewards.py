"""Rewards and final-answer checking."""

from __future__ import annotations

import pytest

from services.controller.tasks.answers import answers_match, final_answer, last_boxed, reference_answer
from services.controller.tasks.rewards import RewardError, get_reward, register_reward, score
from tests.unit.controller.controller_helpers import task


@pytest.mark.parametrize(
    ("text", "answer", "boxed"),
    [
        ("so x = \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", True),
        ("first \\boxed{3}, then \\boxed{4}", "4", True),
        ("The total is 1,234 apples and 5 pears, so 42", "42", False),
        ("answer: -3.5", "-3.5", False),
        ("nothing here", None, False),
        ("cut off \\boxed{12", "12", False),  # unbalanced box: fall back to the last number
    ],
)
def test_final_answer(text: str, answer: str | None, boxed: bool) -> None:
    assert final_answer(text) == (answer, boxed)


def test_reference_answers_and_matching() -> None:
    assert reference_answer("Natalia sold 48/2 = 24 clips... #### 72") == "72"
    assert last_boxed("$\\boxed{x^{2}}$") == "x^{2}"
    assert answers_match("1,000", "1000.0")
    assert answers_match("\\frac{1}{2}", "0.5")
    assert answers_match("\\text{yes}", "Yes")
    assert not answers_match("71", "#### 72")
    assert not answers_match(None, "1")


async def test_math_reward_checks_the_final_answer() -> None:
    math = get_reward("math")
    assert await score(math, task(answer="#### 72"), "... so \\boxed{72}") == (1.0, {"reward": 1.0, "accuracy": 1.0, "boxed": 1.0})
    reward, scores = await score(math, task(answer="72"), "I think 71")
    assert reward == 0.0 and scores["boxed"] == 0.0


async def test_sync_and_async_rewards_registered_by_name() -> None:
    @register_reward("test_async_len")
    async def async_len(t, completion, *, scale=1.0):
        return {"reward": len(completion) * scale, "chars": len(completion)}

    reward, scores = await score(get_reward("test_async_len"), task(), "abcd", scale=0.5)
    assert reward == 2.0 and scores == {"reward": 2.0, "chars": 4.0}
    assert await score(get_reward("services.controller.tasks.rewards:length_reward"), task(), "x" * 100) == (0.0, {"reward": 0.0})


async def test_a_reward_that_raises_or_misbehaves_is_a_reward_error() -> None:
    def broken(t, completion):
        raise ZeroDivisionError("oops")

    with pytest.raises(RewardError, match="ZeroDivisionError: oops"):
        await score(broken, task(), "x")
    with pytest.raises(RewardError, match="without 'reward'"):
        await score(lambda t, c: {"acc": 1}, task(), "x")
    with pytest.raises(RewardError, match="NaN"):
        await score(lambda t, c: float("nan"), task(), "x")
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward("nope")
