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
