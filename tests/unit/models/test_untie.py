"""An untied copy computes what the tied model does, and has a head of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flywheel.models.tiny import build_tiny_model
from flywheel.models.untie import ensure_untied, ties_embeddings, untie_embeddings


def test_the_untied_copy_gives_the_same_logits_and_its_head_trains_alone(tmp_path: Path) -> None:
    tied = build_tiny_model(tmp_path / "tied")
    assert ties_embeddings(tied)
    untied = untie_embeddings(tied, tmp_path / "untied")
    assert not ties_embeddings(untied)
    assert "lm_head.weight" in load_file(untied / "model.safetensors")
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    a, b = (AutoModelForCausalLM.from_pretrained(p) for p in (tied, untied))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    with torch.no_grad():
        b.lm_head.weight.add_(1.0)  # the head is its own now: the input embeddings stay
    assert torch.equal(b.get_input_embeddings().weight, a.get_input_embeddings().weight)
    assert (tmp_path / "untied" / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="does not tie"):
        untie_embeddings(untied, tmp_path / "again")


def test_the_first_start_step_makes_the_copy_once_and_links_a_model_that_does_not_tie(tmp_path: Path) -> None:
    tied = build_tiny_model(tmp_path / "tied")
    out = ensure_untied(tied, tmp_path / "untied")
    made = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_untied(tied, out) == out and (out / "model.safetensors").stat().st_mtime_ns == made
    link = ensure_untied(out, tmp_path / "linked")
    assert link.is_symlink() and link.resolve() == out.resolve() and not ties_embeddings(link)
