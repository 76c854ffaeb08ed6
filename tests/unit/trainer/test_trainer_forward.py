"""The trainer's log-prob forward: the output head at the selected positions only, log-softmax in chunks.

Compared with the plain computation (full logits, float32 log_softmax, autograd)
on a tiny random model: values and gradients must agree."""

from __future__ import annotations

import pytest
import torch

from services.trainer import forward
from services.trainer.forward import _TargetLogprob, token_logprobs


def _plain(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1) * mask[:, 1:]
    return torch.nn.functional.pad(lp, (1, 0)), torch.nn.functional.pad(ent, (1, 0))


@pytest.fixture
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(config).float()


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    loss_mask = mask.clone().float()
    loss_mask[:, :3] = 0  # the prompt
    return ids, mask, loss_mask


def test_target_logprob_matches_log_softmax_and_its_gradient(monkeypatch) -> None:
    monkeypatch.setattr(forward, "_CHUNK_ROWS", 3)  # several chunks, the last one short
    torch.manual_seed(2)
    logits = torch.randn(7, 50, dtype=torch.float64).float().requires_grad_()
    targets = torch.randint(0, 50, (7,))
    weights = torch.randn(7)
    ours = _TargetLogprob.apply(logits, targets, None)
    (ours * weights).sum().backward()
    ours_grad = logits.grad.clone()
    logits.grad = None
    theirs = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    (theirs * weights).sum().backward()
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.allclose(ours_grad, logits.grad, atol=1e-6)


def test_selected_positions_match_the_plain_computation_in_value_and_gradient(model, monkeypatch) -> None:
    monkeypatch.setattr(forward, "_CHUNK_ROWS", 4)
    ids, mask, loss_mask = _batch()
    weights = torch.randn(3, 9)

    lp, ent = token_logprobs(model, ids, mask, select=loss_mask, entropy=True)
    (lp * weights).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain_lp, plain_ent = _plain(model, ids, mask)
    (plain_lp * loss_mask * weights).sum().backward()

    selected = loss_mask > 0
    assert torch.allclose(lp[selected], plain_lp[selected], atol=1e-5)
    assert torch.allclose(ent[selected], plain_ent[selected], atol=1e-5)
    assert (lp[~selected] == 0).all() and (ent[~selected] == 0).all()
    for name, p in model.named_parameters():
        assert torch.allclose(ours[name], p.grad, atol=1e-5), name


def test_without_a_selection_every_real_position_is_computed(model) -> None:
    ids, mask, _ = _batch()
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, mask)
        plain_lp, _ = _plain(model, ids, mask)
    assert torch.allclose(lp, plain_lp, atol=1e-5)
    assert (lp[:, 0] == 0).all() and (lp[1, 6:] == 0).all()


def test_a_soft_capped_head_takes_the_full_logits_path(model) -> None:
    model.config.final_logit_softcapping = 30.0  # not a plain linear head any more: no shortcut may be taken
    assert forward._plain_head(model) is None
    ids, mask, loss_mask = _batch()
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, mask, select=loss_mask)
        plain_lp, _ = _plain(model, ids, mask)
    selected = loss_mask > 0
    assert torch.allclose(lp[selected], plain_lp[selected], atol=1e-5)


def _group(rows: int = 4, prompt: int = 5, width: int = 11):
    """`rows` samples of one prompt: the same first `prompt` tokens, different ragged continuations."""
    torch.manual_seed(3)
    ids = torch.randint(0, 300, (rows, width))
    ids[:, :prompt] = ids[0, :prompt]
    mask = torch.ones(rows, width, dtype=torch.long)
    for row in range(1, rows):
        mask[row, width - row:] = 0
    loss_mask = mask.clone().float()
    loss_mask[:, :prompt] = 0
    return ids, mask, loss_mask


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("sampling", [(None, None, None), (torch.full((4,), 0.7), None, torch.full((4,), 0.9))])
def test_a_shared_prompt_computed_once_gives_the_same_values_and_gradients(model, sampling, attention) -> None:
    model.set_attn_implementation(attention)
    ids, mask, loss_mask = _group()
    weights = torch.randn(4, 11)
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(lambda _, args, kwargs: calls.append(
        tuple(kwargs["input_ids"].shape)), with_kwargs=True)

    def run(shared: int):
        model.zero_grad()
        calls.clear()
        lp, ent = token_logprobs(model, ids, mask, select=loss_mask, entropy=True, sampling=sampling,
                                 shared_prefix=shared)
        (lp * weights).sum().backward()
        return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}, list(calls)

    lp, ent, grads, seen = run(5)
    plain_lp, plain_ent, plain_grads, plain_seen = run(0)
    hook.remove()
    assert seen == [(1, 5), (4, 6)] and plain_seen == [(4, 11)], "the prompt went through the model once"
    assert torch.allclose(lp, plain_lp, atol=1e-5) and torch.allclose(ent, plain_ent, atol=1e-5)
    for name in grads:
        assert torch.allclose(grads[name], plain_grads[name], atol=1e-5), name


def test_the_head_gradient_runs_in_the_autocast_dtype_and_its_logits_in_float32() -> None:
    torch.manual_seed(4)
    hidden = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    logits = forward._Head.apply(hidden, weight, None, torch.bfloat16)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, hidden.detach() @ weight.detach().T)  # not rounded to bfloat16
    grad = torch.randn(6, 40)
    logits.backward(grad)
    low = grad.bfloat16()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert torch.equal(hidden.grad, (low @ weight.detach().bfloat16()).float())
    assert torch.equal(weight.grad, (low.T @ hidden.detach().bfloat16()).float())
    # Close to the float32 gradient all the same (bfloat16's ~3 significant digits).
    assert torch.allclose(hidden.grad, grad @ weight.detach(), rtol=0.05, atol=0.2)


def test_with_gradient_checkpointing_the_prompt_is_not_shared(model) -> None:
    """Checkpointed layers keep no cache to continue from: the rows are computed whole, correctly."""
    model.gradient_checkpointing_enable()
    model.train()
    ids, mask, loss_mask = _group()
    lp, _ = token_logprobs(model, ids, mask, select=loss_mask, shared_prefix=5)
    model.gradient_checkpointing_disable()
    plain, _ = token_logprobs(model, ids, mask, select=loss_mask)
    assert torch.allclose(lp, plain, atol=1e-5)
