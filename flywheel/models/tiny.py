"""Tiny random-initialised causal language models, built offline in seconds.

`build_tiny_model()` writes a complete Hugging Face checkpoint directory
(config.json, model.safetensors, generation_config.json, tokenizer files with a
chat template) for a Qwen2- or Llama-architecture model of a few hundred
thousand parameters, or a Qwen3-MoE one (`arch="qwen3_moe"`: every MLP a
mixture of `num_experts` experts, `num_experts_per_tok` routed per token).
transformers and vLLM (CPU included) both load it, so tests and the local
demo exercise the real code paths without a hub download.

Qwen3-MoE is the mixture-of-experts family: vLLM 0.32's CPU build runs it
(its fused-MoE CPU path) and so does transformers, its router is a plain
softmax top-k (`flywheel.models.moe` replays it), and it is the family the
routing-replay literature measures on (Qwen3-30B-A3B). Its experts are
written as transformers holds them (one `experts.gate_up_proj` and one
`experts.down_proj` tensor per layer, not one tensor per expert): the
trainer's state dict, which is what it publishes, then has the checkpoint's
names, and a rollout checks a version against its checkpoint's names.

The same arguments always give bit-identical files: weights are drawn from an
explicitly seeded generator rather than from transformers' initialisers, whose
order and distributions may change between releases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3MoeConfig,
)

from flywheel.models.smollm2 import apply_umask
from flywheel.models.tokenizer import ENDOFTEXT, IM_END, save_tokenizer

Arch = Literal["qwen2", "llama", "qwen3_moe"]

# vLLM's CPU attention supports only listed head sizes (16 is not one; 0.32
# lists 32, 64, 80, ...). 64 is supported by every backend, CPU and GPU alike.
HEAD_DIM = 64

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CONFIGS: dict[str, type[PretrainedConfig]] = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}


def _check_args(
    *, arch: str, hidden_size: int, num_heads: int, num_kv_heads: int, dtype: str
) -> None:
    """Raise ValueError naming the first bad argument."""
    if arch not in _CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_CONFIGS)}, got {arch!r}")
    if hidden_size != num_heads * HEAD_DIM:
        raise ValueError(
            f"hidden_size ({hidden_size}) must equal num_heads ({num_heads}) * {HEAD_DIM}: "
            f"the head dimension is fixed at {HEAD_DIM} for vLLM's CPU attention"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must be >= 1 and divide num_heads ({num_heads})"
        )
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


def _init_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Fill every parameter from one seeded generator, in parameter order."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() yields a tied embedding once, so tying is kept.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: Arch = "qwen2",
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    init_std: float = 0.02,
    tie_word_embeddings: bool = True,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
) -> Path:
    """Write a random-initialised causal LM checkpoint into `out_dir` and return it.

    The vocabulary is the locally trained byte-level BPE tokenizer's (see
    `flywheel.models.tokenizer`). `hidden_size` must be `num_heads * 64`.
    `dtype` is "float32" or "bfloat16". `seed` drives the weights only; the
    tokenizer is the same for every seed. Existing files in `out_dir` are
    overwritten. `num_experts`, `num_experts_per_tok` and `moe_intermediate_size`
    shape the experts of arch "qwen3_moe" (ignored otherwise).
    """
    # Checked before the tokenizer is trained, so bad arguments fail at once.
    _check_args(
        arch=arch,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(out, max_length=max_position_embeddings)
    eos_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    config_args = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
    )
    if arch == "qwen3_moe":
        config_args.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                           moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
                           mlp_only_layers=[])
    config = _CONFIGS[arch](**config_args)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Drawn in float32 and then cast, so a bfloat16 model is the rounded
    # float32 one with the same seed.
    _init_weights(model, seed, init_std)
    model = model.to(_DTYPES[dtype])
    # Chat turns end with <|im_end|>, plain text with <|endoftext|>: stop on both.
    model.generation_config = GenerationConfig(
        eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id
    )
    model.save_pretrained(out)
    if arch == "qwen3_moe":
        _save_as_held(model, out)
    apply_umask(out / "model.safetensors")
    return out


def _save_as_held(model: torch.nn.Module, out: Path) -> None:
    """Rewrites model.safetensors with the tensors as the model holds them (save_pretrained splits fused
    MoE experts into one tensor per expert; transformers and vLLM load either layout)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
