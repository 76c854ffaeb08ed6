"""Runs inside vLLM's worker process: swaps verified weights in place.

vLLM imports this class by name (`worker_extension_cls`) and mixes it into
its worker, so `collective_rpc("flywheel_load_weights", ...)` reaches the
live model. Weights come as safetensors files the service staged and
verified; they are streamed tensor by tensor into vLLM's own in-place reload,
which also redoes any kernel-specific weight processing (repacking, fusing).

One gap is closed here (`_refresh_kept_cpu_gemms`): on CPU, vLLM packs a copy
of every GEMM weight at load for its kernels, and layers that keep their
weight besides (the token embedding, and an LM head tied to it) are not
repacked by a reload. A model with tied embeddings (SmolLM2, the tiny test
models) then served new weights everywhere but in its output head: samples
came from a model nobody trained.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class FlywheelWorkerExtension:
    def flywheel_load_weights(self, files: list[str]) -> int:
        from safetensors import safe_open

        count = 0

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for file in files:
                with safe_open(file, framework="pt") as fh:
                    for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                        count += 1
                        yield name, fh.get_tensor(name)

        self.model_runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        _refresh_kept_cpu_gemms(self.model_runner.model)  # type: ignore[attr-defined]
        return count


def _refresh_kept_cpu_gemms(model: torch.nn.Module) -> int:
    """Re-ties a tied LM head to the (reloaded) embedding and repacks the CPU GEMM copy of every
    layer that keeps its weight; a no-op off CPU. Returns how many layers were repacked."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    config = getattr(model, "config", None)
    head, body = getattr(model, "lm_head", None), getattr(model, "model", None)
    embedding = getattr(body, "embed_tokens", None)
    if getattr(config, "tie_word_embeddings", False) and head is not None and embedding is not None:
        head.weight = embedding.weight
    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        # Layers whose weight was removed after packing (linear layers) were repacked by the reload.
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked
