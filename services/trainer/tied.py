"""Tied weights: which of several names over one tensor an export keeps.

An HF causal LM may tie two weights (e.g. `lm_head.weight` is
`model.embed_tokens.weight`); `save_pretrained` writes such a tensor once,
and so do the trainer's exports and checkpoints. The rule lives here, below
both the unsharded export (`export.export_state`, tensors grouped by memory)
and the sharded one (`distributed.export_names`, parameters grouped by
object), so the two drop the same names.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn


def tied_targets(model: nn.Module) -> set[str]:
    """Names transformers treats as tied copies of another weight (not saved)."""
    tied = getattr(model, "_tied_weights_keys", None) or ()
    return set(tied.keys() if isinstance(tied, dict) else tied)


def tied_duplicates(groups: Iterable[list[str]], targets: set[str]) -> set[str]:
    """The names to drop from groups of names over one tensor each: the names transformers
    declares tied (`targets`) go first, else every name after the group's first."""
    doomed: set[str] = set()
    for names in groups:
        if len(names) < 2:
            continue
        declared = [n for n in names if n in targets]
        if declared and len(declared) < len(names):
            doomed.update(declared)
        else:
            doomed.update(names[1:])
    return doomed


def drop_tied(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Removes names that share storage with an earlier one (tied weights), as
    save_pretrained does: the names transformers declares tied go first, else
    the later of two names over the same memory."""
    groups: dict[tuple[int, int], list[str]] = {}
    for name, t in state.items():
        if t.numel():
            groups.setdefault((t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(),
                               t.numel() * t.element_size()), []).append(name)
    doomed = tied_duplicates(groups.values(), tied_targets(model))
    return {n: t for n, t in state.items() if n not in doomed}
