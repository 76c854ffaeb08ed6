"""The policy's lifecycle: model (optionally with LoRA), optimizer, schedule, reference.

`Policy.load(config)` reads a causal LM from an HF directory onto the
configured device and dtype, wraps it with peft LoRA adapters when asked
(only adapter weights trainable), and builds AdamW with a warm-up + constant /
linear / cosine schedule. The reference model for a KL term is loaded on first
use (or at load with `reference.preload`); with LoRA it is the same model with
its adapters switched off, which costs no memory.

The step and weight version live here too: both advance by one per
optimizer step and are restored from checkpoints (with several models, each
has its step, and a version numbers one set of weights across all of them).

With LoRA, one base holds several models (`select`, `drop`): each model is
its adapters' values, optimizer and schedule, accumulated gradients, step and
weight version. The selected one is live in the model; the others are parked
in memory (a few copies of the adapters: small beside the base). Switching
copies adapter values in and out and swaps the rest by reference, so a
model's gradients and optimizer moments never touch another's. A new model
starts from the adapters' initialisation (what they held when the policy
loaded) with a fresh optimizer at step 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from flywheel.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from flywheel.models.precision import native_bfloat16
from flywheel.trainer.types import AdamStep, LoraShape
from services.trainer.config import OptimizerConfig, TrainerConfig
from services.trainer.compiled import compile_layers
from services.trainer.distributed import is_sharded, shard_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_dtype(choice: str, device: str) -> torch.dtype | None:
    """The dtype forward matmuls run in for `model.autocast` on `device`; None: no autocast."""
    if choice == "auto":
        return torch.bfloat16 if native_bfloat16(device) else None
    if choice == "bfloat16" and not native_bfloat16(device):
        log.warning(
            "model.autocast bfloat16 on %s, which has no native bfloat16: it runs in emulation, many times "
            "slower than float32; `autocast: auto` picks what is fast on each machine", device,
        )
    return None if choice == "none" else DTYPES[choice]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def lr_factor(step: int, cfg: OptimizerConfig) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (from 0)."""
    if step < cfg.warmup_steps:
        # (step + 1): the first update already moves the weights.
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decays(param: torch.Tensor) -> bool:
    """Whether weight decay applies: not to biases and norm gains (1-D), as in most LLM recipes."""
    return param.dim() >= 2


def optimizer_kernels() -> dict[str, bool]:
    """How AdamW runs its update.

    One fused kernel per parameter group, on every device. On CUDA the per-parameter loop launched
    several kernels per tensor and took 57 ms of a 221 ms step of a 0.5B model on an H200, 159 ms under
    FSDP2, where every launch also goes through DTensor (docs/gpu.md). On a CPU it makes a temporary
    per operation and tensor: 1.85 s a step for SmolLM2-135M's parameters on 2 cores against 0.13 s
    fused (a 2-core AMD EPYC Zen 5). The fused kernel is elementwise, with no reduction, so it is
    bit-reproducible across runs and thread counts."""
    return {"fused": True, "foreach": False}


def restore_optimizer_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Loading a state dict takes the saved groups' kernel choice with it (a checkpoint written by an
    older version would bring its own): choose again."""
    for group in optimizer.param_groups:
        group.update(optimizer_kernels())


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    decay, no_decay = [], []
    for _name, param in model.named_parameters():
        if param.requires_grad:
            (decay if decays(param) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        **optimizer_kernels(),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    return optimizer, scheduler


class Policy:
    """A loaded policy model with its optimizer state; not thread-safe (the engine serialises)."""

    def __init__(self, config: TrainerConfig, model: nn.Module, tokenizer, name: str) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.device = torch.device(config.model.device)
        self.dtype = DTYPES[config.model.dtype]
        self.lora = config.model.lora.enabled
        self.optimizer, self.scheduler = build_optimizer(model, config.optimizer)
        self.step = 0
        self.weight_version = 0
        self._reference: nn.Module | None = None
        #: The newest weight version any of its models reached: a version names one set of weights on this
        #: trainer whichever model made it (`next_version`).
        self._newest_version = 0
        #: The selected model's id ("" is the policy's own: the one it loads with).
        self.model_id = ""
        self._parked: dict[str, ParkedModel] = {}
        self._held: tuple[str, ...] = ("",)
        #: The adapters as initialised, which every new model starts from (LoRA only: nothing to keep else).
        self._initial_adapters = self._adapter_values() if self.lora else {}
        #: The trainer's own adapters' rank and modules, and the selected model's (`select`, `set_shape`).
        self.full_shape = self._full_shape() if self.lora else LoraShape()
        self.shape = self.full_shape

    # ------------------------------------------------------------ loading

    @classmethod
    def load(cls, config: TrainerConfig, shard: bool = False) -> Policy:
        """The policy of `config`; with `shard`, FSDP2-sharded over the default process group
        (`services.trainer.distributed`), the optimizer built over the shards."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        # Progress bars would flood the service's structured log.
        hf_logging.disable_progress_bar()
        mcfg = config.model
        if mcfg.path is None:
            raise ValueError("model.path is not set")
        if mcfg.cpu_threads:
            torch.set_num_threads(mcfg.cpu_threads)
        seed_everything(mcfg.seed)
        if mcfg.deterministic:
            # cuBLAS is deterministic only with a fixed workspace, set before CUDA starts.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            # warn_only: some CUDA kernels have no deterministic variant; CPU ones all do.
            torch.use_deterministic_algorithms(True, warn_only=True)
            # Deterministic mode also fills every new tensor with NaN, to expose reads of memory no kernel
            # wrote: a debugging aid, not part of determinism, and a tenth of a CPU training step.
            torch.utils.deterministic.fill_uninitialized_memory = False
        model = AutoModelForCausalLM.from_pretrained(
            str(mcfg.path), dtype=DTYPES[mcfg.dtype], attn_implementation=mcfg.attn_implementation
        )
        if not shard:
            model = model.to(mcfg.device)  # a sharded model moves there shard by shard
        model.config.use_cache = False
        if mcfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mcfg.lora.enabled:
            model = _wrap_lora(model, config)
        if mcfg.compile:
            compile_layers(model)
        if shard:
            model = shard_model(model, mcfg.device)
        model.train()
        policy = cls(config, model, _load_tokenizer(mcfg.path), str(mcfg.path))
        if config.reference.preload:
            policy.reference_context()  # loads it now
        log.info(
            "policy loaded",
            extra={"model": policy.name, "parameters": policy.parameter_count, "trainable": policy.trainable_count,
                   "device": str(policy.device), "dtype": mcfg.dtype, "lora": policy.lora},
        )
        return policy

    def _load_reference(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        path = self.config.reference.path or self.config.model.path
        ref = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=self.dtype, attn_implementation=self.config.model.attn_implementation
        ).to(self.device)
        ref.eval().requires_grad_(False)
        log.info("reference model loaded", extra={"path": str(path)})
        return ref

    @contextlib.contextmanager
    def reference_context(self) -> Iterator[nn.Module]:
        """Yields the module that computes reference log-probs."""
        if self.lora and self.config.reference.path is None:
            with self.model.disable_adapter():
                yield self.model
            return
        if self._reference is None:
            self._reference = self._load_reference()
        yield self._reference

    # ------------------------------------------------------------ facts

    # Cached: GetInfo reads them while a step may be running, and they never change.
    @functools.cached_property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @functools.cached_property
    def trainable_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_model.get_input_embeddings().num_embeddings)

    @property
    def hf_model(self) -> nn.Module:
        """The transformers model (below the peft wrapper when LoRA is on)."""
        return self.model.get_base_model() if self.lora else self.model

    @functools.cached_property
    def sharded(self) -> bool:
        """Whether the model is FSDP2-sharded over ranks (`parallel`)."""
        return is_sharded(self.model)

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @contextlib.contextmanager
    def adam_overrides(self, adam: AdamStep) -> Iterator[None]:
        """The optimizer's groups with `adam`'s values for one step, then as they were (the
        schedule's learning rate included): weight decay only where it applies (`decays`)."""
        groups = self.optimizer.param_groups
        saved = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in groups]
        try:
            for g in groups:
                if adam.learning_rate is not None:
                    g["lr"] = adam.learning_rate
                if adam.beta1 is not None or adam.beta2 is not None:
                    b1, b2 = g["betas"]
                    g["betas"] = (b1 if adam.beta1 is None else adam.beta1, b2 if adam.beta2 is None else adam.beta2)
                if adam.eps is not None:
                    g["eps"] = adam.eps
                if adam.weight_decay is not None and any(decays(p) for p in g["params"]):
                    g["weight_decay"] = adam.weight_decay
            yield
        finally:
            for g, values in zip(groups, saved):
                g.update(values)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def has_gradients(self) -> bool:
        return any(p.grad is not None for p in self.trainable_parameters())

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def next_version(self) -> int:
        """The weight version an optimizer step makes: one past the newest of every model's (and of the
        one loaded), so two models never number different weights alike; with one model, step by step."""
        self._newest_version = max(self._newest_version, self.weight_version) + 1
        return self._newest_version

    # ------------------------------------------------------------ models

    @property
    def model_ids(self) -> tuple[str, ...]:
        """Every model held: the selected one first, then the parked ones (a copy made under the
        engine's lock: GetInfo reads it while a step may run)."""
        return self._held

    def _adapter_values(self) -> dict[str, Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}

    def select(self, model_id: str, max_models: int, shape: LoraShape = LoraShape()) -> bool:
        """Makes `model_id` the live model, parking the selected one; True when it is new (created
        from the adapters' initialisation, of `shape`: see `set_shape`). At most `max_models` are held."""
        if model_id == self.model_id:
            return False
        if not self.lora:
            raise FailedPrecondition("several models on one trainer need LoRA adapters (model.lora.enabled): with "
                                     "every parameter trained there is one model")
        created = model_id not in self._parked
        if created:
            shape = self.resolve_shape(shape)
        if created and len(self._parked) + 1 >= max_models:
            raise ResourceExhausted(f"the trainer holds {max_models} models (limits.max_models); drop one first")
        # A checkpoint loaded into the model being parked may carry a version past every step taken here.
        self._newest_version = max(self._newest_version, self.weight_version)
        params = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        parked = ParkedModel(self._adapter_values(), {n: p.grad for n, p in params.items()},
                             self.optimizer, self.scheduler, self.step, self.weight_version, self.shape)
        incoming = self._parked.pop(model_id, None)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(incoming.adapters[name] if incoming else self._initial_adapters[name])
                p.grad = incoming.grads[name] if incoming else None
        if incoming is None:
            self.set_shape(shape)
            self.optimizer, self.scheduler = build_optimizer(self.model, self.config.optimizer)
            self.step = self.weight_version = 0
        else:
            self._scale(incoming.shape)
            self.optimizer, self.scheduler = incoming.optimizer, incoming.scheduler
            self.step, self.weight_version = incoming.step, incoming.weight_version
        self._parked[self.model_id] = parked
        self.model_id = model_id
        self._held = (model_id, *self._parked)
        return created

    def drop(self, model_id: str) -> None:
        """Forgets a parked model (its adapters, optimizer state and gradients)."""
        if model_id == self.model_id:
            raise FailedPrecondition(f"model {model_id!r} is selected: select another before dropping it")
        if self._parked.pop(model_id, None) is None:
            raise NotFound(f"model {model_id!r} is not held by this trainer")
        self._held = (self.model_id, *self._parked)

    # ------------------------------------------------------------ each model's rank and modules

    def _lora_layers(self) -> list[tuple[str, nn.Module]]:
        from peft.tuners.lora import LoraLayer

        return [(name.rsplit(".", 1)[-1], module) for name, module in self.model.named_modules()
                if isinstance(module, LoraLayer)]

    def _full_shape(self) -> LoraShape:
        return LoraShape(self.config.model.lora.rank, tuple(sorted({short for short, _ in self._lora_layers()})))

    def resolve_shape(self, shape: LoraShape) -> LoraShape:
        """`shape` with the trainer's own rank or modules where it names none; InvalidArgument past them."""
        rank = shape.rank or self.full_shape.rank
        modules = tuple(sorted(set(shape.modules))) or self.full_shape.modules
        if not 1 <= rank <= self.full_shape.rank:
            raise InvalidArgument(f"lora rank {rank}: this trainer's adapters have rank {self.full_shape.rank}, "
                                  f"the most a model may have")
        if unknown := sorted(set(modules) - set(self.full_shape.modules)):
            raise InvalidArgument(f"lora modules {', '.join(unknown)}: this trainer has adapters on "
                                  f"{', '.join(self.full_shape.modules)} only")
        return LoraShape(rank, modules)

    def set_shape(self, shape: LoraShape) -> None:
        """Gives the live model `shape` (resolved): the adapters' rows and columns past its rank, and those of
        modules it does not adapt, are set to zero, and every adapted module scaled by alpha / its rank. A
        zero row of A and the matching zero column of B get zero gradients (each one's gradient goes through
        the other), so Adam and weight decay leave them at zero: the model trains exactly a LoRA of that rank
        on those modules. Its adapters are its own from there on (it must be selected)."""
        with torch.no_grad():
            for short, module in self._lora_layers():
                for adapter in module.active_adapters:
                    a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
                    if short in shape.modules:
                        a[shape.rank:] = 0
                        b[:, shape.rank:] = 0
                    else:
                        a.zero_()
                        b.zero_()
        self._scale(shape)

    def _scale(self, shape: LoraShape) -> None:
        alpha = self.config.model.lora.alpha
        for _, module in self._lora_layers():
            for adapter in module.active_adapters:
                module.scaling[adapter] = alpha / shape.rank
        self.shape = shape

    def trim_to_shape(self, adapters: dict[str, Tensor]) -> dict[str, Tensor]:
        """The live model's adapters (peft names) as a LoRA of its own shape: its modules only, A's first
        rank rows and B's first rank columns."""
        out = {}
        for name, tensor in adapters.items():
            module = name.split(".lora_")[0].rsplit(".", 1)[-1]
            if module not in self.shape.modules:
                continue
            if ".lora_A." in name:
                tensor = tensor[: self.shape.rank]
            elif ".lora_B." in name:
                tensor = tensor[:, : self.shape.rank]
            out[name] = tensor.contiguous()
        return out

    # ------------------------------------------------------------ weights

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Weights under their HF names; LoRA deltas merged in (out of place: the live model is untouched)."""
        if not self.lora:
            return self.model.state_dict()
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        merged: dict[str, Tensor] = {}
        for key, value in base.state_dict().items():
            if "lora_" not in key:
                merged[key.replace(".base_layer.", ".")] = value
        with torch.no_grad():
            for prefix, module in base.named_modules():
                if isinstance(module, LoraLayer) and hasattr(module, "get_delta_weight"):
                    weight = f"{prefix}.weight"
                    delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
                    merged[weight] = (merged[weight] + delta).to(merged[weight].dtype)
        return merged


@dataclasses.dataclass
class ParkedModel:
    """A model that is not selected: what `Policy.select` swaps in to make it live again."""

    adapters: dict[str, Tensor]
    grads: dict[str, Tensor | None]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int
    weight_version: int
    shape: LoraShape


def _wrap_lora(model: nn.Module, config: TrainerConfig) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lcfg = config.model.lora
    targets: list[str] | str = lcfg.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    peft_config = LoraConfig(
        r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, peft_config)


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        # Training needs only token ids; checkpoints just lack a tokenizer then.
        log.warning("no tokenizer in the model directory", extra={"path": str(path), "error": str(exc)})
        return None


def rng_state() -> dict:
    """Every RNG a training step may draw from (dropout, sampling in hooks)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
