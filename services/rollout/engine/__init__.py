"""Inference engines behind the rollout service (see `base.Engine`).

`create_engine` picks vLLM when it is installed (kind "auto") and the
transformers engine otherwise; both modules import their heavy dependencies
only when an engine is created.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from flywheel.errors import FailedPrecondition
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import Engine
from services.rollout.engine.text import TextCodec


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def create_engine(config: RolloutConfig, codec: TextCodec) -> Engine:
    engine = config.engine
    if engine.model_path is None:
        raise FailedPrecondition("engine.model_path is not set")
    kind = engine.kind
    if kind == "auto":
        kind = "vllm" if vllm_available() else "transformers"
    if kind == "vllm":
        if not vllm_available():
            raise FailedPrecondition("engine.kind is vllm but the vllm package is not installed")
        from services.rollout.engine.vllm_engine import VllmEngine

        made: Engine = VllmEngine(Path(engine.model_path), engine.args, codec, engine.initial_version,
                                  config.updates.reuse_staging, logprobs_mode=engine.logprobs,
                                  prepare_outside_pause=_prepares_outside_pause(config),
                                  max_adapters=config.adapters.max_resident, max_adapter_rank=config.adapters.max_rank,
                                  cores=engine.cores())
        made.max_kept_ids = engine.max_kept_ids
        return made
    from services.rollout.engine.transformers_engine import TransformersEngine

    if (cores := engine.cores()) is not None:
        import torch

        torch.set_num_threads(len(cores))
    made = TransformersEngine(Path(engine.model_path), engine.args, codec, engine.initial_version)
    made.logprobs_mode = engine.logprobs
    made.max_kept_ids = engine.max_kept_ids
    return made


def _prepares_outside_pause(config: RolloutConfig) -> bool:
    """updates.prepare_outside_pause, its default resolved: on for vLLM on the CPU (where the in-place reload's
    repacking is the pause), off on a GPU."""
    if config.updates.prepare_outside_pause is not None:
        return config.updates.prepare_outside_pause
    import torch

    return not torch.cuda.is_available()
