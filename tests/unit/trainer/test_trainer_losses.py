"""The RL losses against values computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.losses import (
    LossSettings,
    aggregate,
    clipped_surrogate,
    entropy_from_logits,
    entropy_metric,
    group_advantages,
    kl_penalty,
    loss_denominators,
    overlong_penalty,
    policy_loss,
    truncated_is_weights,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # third sequence has no loss tokens


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", (1 + 2 + 4) / 3),
        ("seq_mean_token_mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq_mean_token_sum", ((1 + 2) + 4) / 2),
    ],
)
def test_aggregation_modes(mode: str, expected: float) -> None:
    assert float(aggregate(VALUES, MASK, mode)) == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batches_with_global_denominators_sum_to_the_whole(mode: str) -> None:
    tokens, seqs = loss_denominators(MASK)
    assert (tokens, seqs) == (3.0, 2.0)
    parts = [aggregate(VALUES[i : i + 1], MASK[i : i + 1], mode, num_tokens=tokens, num_seqs=seqs) for i in range(3)]
    assert float(sum(parts)) == pytest.approx(float(aggregate(VALUES, MASK, mode)))


def test_dr_grpo_divides_token_sums_by_a_constant_length() -> None:
    """Dr. GRPO by hand: sums 1+2=3 and 4 over 2 sequences (the empty third does not count) x 8 tokens,
    whatever the padded width (3 here, 5 below)."""
    expected = (3 + 4) / (2 * 8)
    assert float(aggregate(VALUES, MASK, "seq_mean_token_sum_norm", max_response_length=8)) == pytest.approx(expected)
    wider_values = torch.nn.functional.pad(VALUES, (0, 2), value=100.0)
    wider_mask = torch.nn.functional.pad(MASK, (0, 2))
    assert float(aggregate(wider_values, wider_mask, "seq_mean_token_sum_norm", max_response_length=8)) == pytest.approx(
        expected)
    # Micro-batches with the batch's sequence count add up to the whole, as for the other modes.
    _, seqs = loss_denominators(MASK)
    parts = [aggregate(VALUES[i : i + 1], MASK[i : i + 1], "seq_mean_token_sum_norm", num_seqs=seqs,
                       max_response_length=8) for i in range(3)]
    assert float(sum(parts)) == pytest.approx(expected)
    # Its gradient: every loss token weighs 1 / (sequences x length), however long its answer.
    values = VALUES.clone().requires_grad_(True)
    aggregate(values, MASK, "seq_mean_token_sum_norm", max_response_length=8).backward()
    assert torch.allclose(values.grad, MASK / 16)
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate(VALUES, MASK, "seq_mean_token_sum_norm")


def test_unknown_aggregation_is_an_error() -> None:
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(VALUES, MASK, "mean")


def _lp(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, old_logprobs) whose exp-difference is each ratio."""
    old = torch.full((len(ratios),), -1.0)
    return (old + torch.log(torch.tensor(ratios))).requires_grad_(True), old


def test_clipped_surrogate_both_sides_and_gradients() -> None:
    # ratio, advantage: clipped above, clipped below, outside-but-pessimistic (x2), inside.
    logprobs, old = _lp([1.5, 0.5, 0.5, 1.5, 1.1])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    loss, _ratio, low, high = clipped_surrogate(logprobs, old, adv, clip_low=0.2, clip_high=0.28)
    assert loss.tolist() == pytest.approx([-1.28, 0.8, -0.5, 1.5, -2.2], abs=1e-6)
    assert high.tolist() == [True, False, False, False, False]
    assert low.tolist() == [False, True, False, False, False]
    loss.sum().backward()
    # d(-A r)/d logp = -A r where the unclipped branch is active, 0 where clipped.
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, -0.5, 1.5, -2.2], abs=1e-6)


def test_dapo_clip_higher_lets_a_ratio_through_that_symmetric_clip_stops() -> None:
    logprobs, old = _lp([1.25])
    adv = torch.tensor([1.0])
    symmetric, *_ = clipped_surrogate(logprobs, old, adv, 0.2, 0.2)
    asymmetric, *_ = clipped_surrogate(logprobs, old, adv, 0.2, 0.28)
    assert float(symmetric.detach()) == pytest.approx(-1.2)
    assert float(asymmetric.detach()) == pytest.approx(-1.25)


def test_kl_estimators() -> None:
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log(pi / pi_ref) = 0.5
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(0.5)
    assert float(kl_penalty(logp, ref, "k2")) == pytest.approx(0.125)
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert float(kl_penalty(ref, ref, "k3")) == 0.0
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


def test_truncated_is_weights_cap_and_no_gradient() -> None:
    proximal = torch.tensor([-1.0, -2.0], requires_grad=True)
    behaviour = torch.tensor([-2.0, -1.0])
    w = truncated_is_weights(proximal, behaviour, cap=2.0)
    assert w.tolist() == pytest.approx([2.0, math.exp(-1.0)])  # e^1 truncated to 2
    assert not w.requires_grad


def test_off_policy_correction_hand_computed() -> None:
    # One sequence, tokens 1 and 2 in the loss; trainer (proximal) log-probs
    # -1, -2; behaviour -1.5, -1.5 => raw IS weights e^0.5 = 1.6487 (capped
    # to 1.5) and e^-0.5 = 0.6065.
    logprobs = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    behaviour = torch.tensor([[0.0, -1.5, -1.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = torch.full((1, 3), 2.0)
    settings = LossSettings(kind="ppo_clip", aggregation="token_mean", is_cap=1.5)
    out = policy_loss(settings, logprobs=logprobs, mask=mask, advantages=adv, behaviour_logprobs=behaviour)
    w2 = math.exp(-0.5)
    # The ratio against the (detached) proximal policy is 1: loss = -A * w per token.
    assert float(out.loss.detach()) == pytest.approx((-2 * 1.5 - 2 * w2) / 2)
    m = out.metrics()
    assert m["is_weight_mean"] == pytest.approx((1.5 + w2) / 2)
    assert m["is_weight_min"] == pytest.approx(w2)
    assert m["is_weight_max"] == pytest.approx(1.5)
    assert m["is_truncated_fraction"] == pytest.approx(0.5)
    assert m["clip_fraction"] == 0.0 and m["approx_kl"] == 0.0
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -1.5, -w2])


def test_off_policy_correction_against_given_old_logprobs() -> None:
    logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1.2]])
    behaviour = torch.tensor([[0.0, -3.0]])
    mask = torch.tensor([[0.0, 1.0]])
    adv = torch.ones(1, 2)
    settings = LossSettings(aggregation="token_mean", clip_low=0.5, clip_high=0.5, is_cap=2.0)
    out = policy_loss(settings, logprobs=logprobs, mask=mask, advantages=adv, behaviour_logprobs=behaviour,
                      old_logprobs=old)
    ratio = math.exp(0.2)  # pi / pi_old, inside the clip range
    assert float(out.loss.detach()) == pytest.approx(-ratio * 2.0)  # IS weight e^1.8 truncated to 2
    assert out.metrics()["approx_kl"] == pytest.approx(math.exp(-0.2) - 1 + 0.2)


def test_without_is_the_ratio_is_taken_against_behaviour_logprobs() -> None:
    logprobs = torch.tensor([[0.0, -1.0, -1.0]])
    behaviour = torch.tensor([[0.0, -1.0 - math.log(1.5), -1.0]])  # ratios 1.5 and 1
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = torch.ones(1, 3)
    out = policy_loss(LossSettings(aggregation="token_mean"), logprobs=logprobs, mask=mask, advantages=adv,
                      behaviour_logprobs=behaviour)
    assert float(out.loss.detach()) == pytest.approx((-1.2 - 1.0) / 2)
    assert out.metrics()["clip_fraction"] == pytest.approx(0.5)
    assert out.metrics()["clip_fraction_high"] == pytest.approx(0.5)


def test_kl_and_entropy_terms_add_to_the_loss() -> None:
    logprobs = torch.tensor([[0.0, -1.0, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = torch.zeros(1, 3)  # no policy-gradient term
    ref = torch.tensor([[0.0, -1.5, -2.0]])
    entropy = torch.tensor([[0.0, 3.0, 1.0]])
    settings = LossSettings(aggregation="seq_mean_token_sum", kl_coef=0.1, entropy_coef=0.01, kl_estimator="k1")
    out = policy_loss(settings, logprobs=logprobs, mask=mask, advantages=adv, behaviour_logprobs=logprobs,
                      ref_logprobs=ref, entropy=entropy)
    assert float(out.loss.detach()) == pytest.approx(0.1 * 0.5 - 0.01 * 4.0)
    m = out.metrics()
    assert m["kl_loss"] == pytest.approx(0.5) and m["kl"] == pytest.approx(0.25)
    assert m["entropy"] == pytest.approx(2.0) and m["entropy_loss"] == pytest.approx(4.0)


def test_masked_tokens_do_not_count() -> None:
    logprobs = torch.tensor([[0.0, -1.0, -1.0]])
    behaviour = torch.tensor([[0.0, -1.0, -9.0]])  # a wild value under mask 0
    adv = torch.ones(1, 3)
    out = policy_loss(LossSettings(aggregation="token_mean"), logprobs=logprobs,
                      mask=torch.tensor([[0.0, 1.0, 0.0]]), advantages=adv, behaviour_logprobs=behaviour)
    assert float(out.loss.detach()) == pytest.approx(-1.0)
    assert out.tokens == 1.0


def test_missing_inputs_are_errors() -> None:
    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="behaviour"):
        policy_loss(LossSettings(is_cap=2.0), logprobs=t, mask=t, advantages=t)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(LossSettings(kl_coef=0.1), logprobs=t, mask=t, advantages=t, behaviour_logprobs=t)


def test_merged_outputs_weight_means_by_tokens() -> None:
    settings = LossSettings(aggregation="token_mean")
    lp = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    ent = torch.tensor([[0.0, 1.0, 1.0], [0.0, 4.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv = torch.ones(2, 3)
    tokens, seqs = loss_denominators(mask)
    outs = [policy_loss(settings, logprobs=lp[i:i + 1], mask=mask[i:i + 1], advantages=adv[i:i + 1],
                        behaviour_logprobs=lp[i:i + 1], entropy=ent[i:i + 1], num_tokens=tokens, num_seqs=seqs)
            for i in range(2)]
    whole = policy_loss(settings, logprobs=lp, mask=mask, advantages=adv, behaviour_logprobs=lp, entropy=ent)
    merged = outs[0].merge(outs[1]).metrics()
    assert merged["entropy"] == pytest.approx(2.0) == pytest.approx(whole.metrics()["entropy"])
    assert merged["loss"] == pytest.approx(whole.metrics()["loss"]) == pytest.approx(-1.0)


def test_group_advantages() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert adv[4:].tolist() == [0.0] * 4  # a group with equal rewards teaches nothing
    assert group_advantages(rewards, 4, scale_by_std=False)[:2].tolist() == [0.5, -0.5]
    with pytest.raises(ValueError):
        group_advantages(rewards, 3)


def test_overlong_penalty() -> None:
    lengths = torch.tensor([5, 6, 8, 10, 12])
    assert overlong_penalty(lengths, max_length=10, cache_length=4).tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]


# ---------------------------------------------------------------- Tinker's unclipped losses

LOGP = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, -0.2]], requires_grad=True)
LOSS_MASK = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_cross_entropy_sums_weight_times_logprob_and_takes_weights_of_any_sign() -> None:
    weights = torch.tensor([[9.0, 2.0, -1.0], [0.5, -3.0, 7.0]])  # outside the mask: not counted
    out = policy_loss(LossSettings(kind="cross_entropy", aggregation="sum"), logprobs=LOGP, mask=LOSS_MASK,
                      advantages=weights)
    expected = -(2.0 * -1.0 + -1.0 * -2.0 + 0.5 * -0.1 + -3.0 * -3.0)
    assert float(out.loss) == pytest.approx(expected) and out.parts["loss"] == pytest.approx(expected)
    (grad,) = torch.autograd.grad(out.loss, LOGP)
    assert torch.equal(grad, -weights * LOSS_MASK)  # d(-w·logp)/dlogp: what a custom loss's gradient needs
    assert "clip_fraction" not in out.token_sums and out.tokens == 4.0


def test_importance_sampling_weights_each_advantage_by_p_over_the_samplers_q() -> None:
    sampler = torch.tensor([[-9.0, -1.5, -1.0], [-0.1, -2.0, -9.0]])
    advantages = torch.tensor([[0.0, 1.0, 2.0], [-1.0, 0.5, 0.0]])
    out = policy_loss(LossSettings(kind="importance_sampling", aggregation="sum"), logprobs=LOGP, mask=LOSS_MASK,
                      advantages=advantages, behaviour_logprobs=sampler)
    ratio = torch.exp(LOGP.detach() - sampler)
    expected = -float((advantages * ratio * LOSS_MASK).sum())
    assert float(out.loss) == pytest.approx(expected)
    assert out.token_sums["ratio_mean"] / out.tokens == pytest.approx(float((ratio * LOSS_MASK).sum()) / 4)
    # No clip: a ratio of e^0.5 (row 0, token 1) still carries its gradient.
    (grad,) = torch.autograd.grad(out.loss, LOGP)
    assert grad[0, 1] == pytest.approx(-1.0 * math.exp(0.5))


def test_sum_reduction_divides_by_nothing() -> None:
    assert float(aggregate(VALUES, MASK, "sum")) == 1 + 2 + 4


# ---------------------------------------------------------------- Tinker's clipped losses: ppo and cispo

# Per token: the current log-prob, the ratio p/q to the sampler and the advantage. With the thresholds
# [0.9, 1.3] the ratios are above (1.5), below (0.5) and inside (1.1) the range, each with both signs of
# advantage; the last token (a wild ratio) is outside the loss mask.
CLIP_LOGP = [[-1.0, -0.5, -2.0], [-0.2, -3.0, -0.7]]
CLIP_RATIO = torch.tensor([[1.5, 1.5, 0.5], [0.5, 1.1, 5.0]], dtype=torch.float64)
CLIP_ADV = torch.tensor([[1.0, -1.0, 2.0], [-1.0, 0.5, 3.0]], dtype=torch.float64)
CLIP_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
# Tinker's thresholds [0.9, 1.3] as the trainer's epsilons around 1.
CLIP = {"clip_low": 1 - 0.9, "clip_high": 1.3 - 1}


def _clip_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """(current log-probs with their gradient, the sampler's log-probs q = log p - log ratio), float64."""
    logp = torch.tensor(CLIP_LOGP, dtype=torch.float64, requires_grad=True)
    return logp, logp.detach() - torch.log(CLIP_RATIO)


def test_tinkers_ppo_is_ppo_clip_summed_pessimistic_on_both_sides() -> None:
    """Tinker's ppo by hand: -min(r A, clip(r, 0.9, 1.3) A) per token, summed; where the clipped
    branch wins the token has no gradient, elsewhere d/dlogp(-A r) = -A r."""
    logp, sampler = _clip_inputs()
    settings = LossSettings(kind="ppo_clip", aggregation="sum", **CLIP)
    out = policy_loss(settings, logprobs=logp, mask=CLIP_MASK, advantages=CLIP_ADV, behaviour_logprobs=sampler)
    per_token = [-min(1.5, 1.3), -min(-1.5, -1.3), -min(1.0, 1.8), -min(-0.5, -0.9), -min(0.55, 0.55)]
    assert per_token == pytest.approx([-1.3, 1.5, -1.0, 0.9, -0.55])
    assert float(out.loss.detach()) == pytest.approx(sum(per_token)) and out.parts["loss"] == pytest.approx(-0.45)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert grad.flatten().tolist() == pytest.approx([0.0, 1.5, -1.0, 0.0, -0.55, 0.0])
    m = out.metrics()  # clipped: token 1 (above, A > 0) and token 4 (below, A < 0), of 5
    assert (m["clip_fraction_high"], m["clip_fraction_low"]) == pytest.approx((0.2, 0.2))


def test_tinkers_cispo_weights_each_log_prob_by_the_clipped_ratio_held_constant() -> None:
    """cispo by hand: -sg(clip(r, 0.9, 1.3)) A log p per token, summed. Its gradient is the stop-gradient
    form -clip(r) A: a token outside the clip range keeps a gradient (PPO's would be 0), and no
    gradient flows through the ratio, which the numerical derivative of the loss shows."""
    logp, sampler = _clip_inputs()
    settings = LossSettings(kind="cispo", aggregation="sum", **CLIP)

    def loss_at(values: torch.Tensor) -> torch.Tensor:
        return policy_loss(settings, logprobs=values, mask=CLIP_MASK, advantages=CLIP_ADV,
                           behaviour_logprobs=sampler).loss

    out = policy_loss(settings, logprobs=logp, mask=CLIP_MASK, advantages=CLIP_ADV, behaviour_logprobs=sampler)
    weights = [[1.3, 1.3, 0.9], [0.9, 1.1, 0.0]]  # clip(r); the masked token does not count
    per_token = [-w * a * lp for wr, ar, lr in zip(weights, CLIP_ADV.tolist(), CLIP_LOGP, strict=True)
                 for w, a, lp in zip(wr, ar, lr, strict=True)]
    assert per_token[:5] == pytest.approx([1.3, -0.65, 3.6, -0.18, 1.65])
    assert float(out.loss.detach()) == pytest.approx(5.72) and out.parts["pg_loss"] == pytest.approx(5.72)
    (grad,) = torch.autograd.grad(out.loss, logp)
    expected = [[-1.3, 1.3, -1.8], [0.9, -0.55, 0.0]]  # -clip(r) A
    assert grad.flatten().tolist() == pytest.approx(sum(expected, []))
    # Numerically: where the ratio is clipped the weight is locally constant, so the loss's own derivative
    # is the gradient; inside the range the loss also moves through r (d r/d log p = r), which the
    # stop-gradient leaves out of the gradient: numerical = gradient - A r log p there.
    h = 1e-6
    for b, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        step = torch.zeros_like(logp)
        step[b, t] = h
        numerical = float(loss_at(logp.detach() + step) - loss_at(logp.detach() - step)) / (2 * h)
        r, a, lp = float(CLIP_RATIO[b, t]), float(CLIP_ADV[b, t]), CLIP_LOGP[b][t]
        through_ratio = -a * r * lp if 0.9 < r < 1.3 else 0.0
        assert numerical == pytest.approx(float(grad[b, t]) + through_ratio, abs=1e-6)
        if through_ratio:  # the in-range token: 1.1 numerically, -0.55 the gradient
            assert numerical == pytest.approx(1.1, abs=1e-6) and float(grad[b, t]) == pytest.approx(-0.55)
    m = out.metrics()  # weights clipped: tokens 1 and 2 above, 3 and 4 below, whatever the advantage's sign
    assert (m["clip_fraction_high"], m["clip_fraction_low"], m["clip_fraction"]) == pytest.approx((0.4, 0.4, 0.8))


def test_cispos_default_clip_is_one_sided() -> None:
    """Tinker's cispo default [0, 4]: a small ratio is its own weight, a large one is capped at 4."""
    from flywheel.trainer.types import CISPO_CLIP_HIGH, CISPO_CLIP_LOW

    logp, sampler = _clip_inputs()
    settings = LossSettings(kind="cispo", aggregation="sum", clip_low=CISPO_CLIP_LOW, clip_high=CISPO_CLIP_HIGH)
    out = policy_loss(settings, logprobs=logp, mask=torch.ones_like(CLIP_MASK), advantages=torch.ones_like(CLIP_ADV),
                      behaviour_logprobs=sampler)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert grad.flatten().tolist() == pytest.approx([-1.5, -1.5, -0.5, -0.5, -1.1, -4.0])
    assert out.metrics()["clip_fraction_low"] == 0.0


def test_cispo_takes_no_truncated_importance_weights() -> None:
    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="cispo takes no truncated importance weights"):
        policy_loss(LossSettings(kind="cispo", is_cap=2.0), logprobs=t, mask=t, advantages=t, behaviour_logprobs=t)


def test_the_entropy_metric_is_the_entropy_also_where_a_sampler_cut_tokens() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[:3, :40] = float("-inf")  # a kept set of 10: the cut tokens count 0
    probs = torch.softmax(logits, dim=-1).double()
    by_definition = -(probs * torch.where(probs > 0, probs.log(), 0.0)).sum(-1).float()
    assert torch.allclose(entropy_metric(logits), by_definition, atol=1e-5)
    assert torch.allclose(entropy_metric(logits), entropy_from_logits(logits), atol=1e-5)
    assert entropy_metric(torch.zeros(1, 8)).item() == pytest.approx(math.log(8), abs=1e-6)
