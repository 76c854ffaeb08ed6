"""An HF model directory written from a state dict the caller already holds.

Used where `save_pretrained` cannot read the weights itself: a sharded
policy's parameters are freed shards, so rank 0 gathers them first
(`distributed.gather_state`) and writes the gathered copy with `save_hf`
(checkpoints' `model/`, CHECKPOINT exports).
"""

from __future__ import annotations

from torch import Tensor, nn


def save_hf(model: nn.Module, directory, state: dict[str, Tensor]) -> None:
    """An HF model directory (config, generation config, one safetensors file) of gathered
    weights: `save_pretrained` reads the sharded model's own (freed) parameters and cannot."""
    from safetensors.torch import save_file

    model.config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in state.items()}, f"{directory}/model.safetensors", metadata={"format": "pt"})
