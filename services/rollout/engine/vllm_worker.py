"""Runs inside vLLM's worker process: swaps verified weights in place.

vLLM imports this class by name (`worker_extension_cls`) and mixes it into
its worker, so `collective_rpc("flywheel_load_weights", ...)` reaches the
live model. Weights come as safetensors files the service staged and
verified; they are streamed tensor by tensor into vLLM's own in-place reload,
which also redoes any kernel-specific weight processing (repacking, fusing).
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
        return count
