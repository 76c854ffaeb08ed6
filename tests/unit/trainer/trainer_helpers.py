"""Helpers of the trainer's unit tests: a batch, an engine for a block, and snapshots of the engine's state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from services.trainer.config import TrainerConfig
from services.trainer.training import TrainingEngine


@contextlib.contextmanager
def loaded_engine(config: TrainerConfig) -> Iterator[TrainingEngine]:
    """An engine on `config`, loaded, and closed (its ranks too) when the block ends."""
    engine = TrainingEngine(config)
    engine.load()
    try:
        yield engine
    finally:
        engine.close()


def make_batch(batch_size: int = 4, seq_len: int = 12, prompt_len: int = 5, seed: int = 0) -> dict:
    """Random ids, ragged right padding, completion loss mask, mixed advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 700, (batch_size, seq_len), generator=g)
    attention = torch.ones(batch_size, seq_len, dtype=torch.int64)
    for row in range(1, batch_size, 2):
        attention[row, seq_len - row:] = 0
    ids = ids * attention
    loss_mask = torch.zeros(batch_size, seq_len)
    loss_mask[:, prompt_len:] = 1.0
    loss_mask *= attention
    advantages = torch.linspace(-1.0, 1.0, batch_size)
    behaviour = -torch.rand(batch_size, seq_len, generator=g) * 0.1 - 6.9  # about log(1/1000)
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "advantages": advantages,
        "behaviour_logprobs": behaviour * loss_mask,
        "weight_versions": torch.zeros(batch_size, dtype=torch.int64),
    }


def parameters(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.policy.model.named_parameters()}


def optimizer_state(engine: TrainingEngine) -> list[torch.Tensor]:
    return [t.clone() for s in engine.policy.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def same_tensors(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
