"""The trainer's probe of each version it publishes (`flywheel.probe`).

With every version, whatever the method, the trainer sends the float32
log-probs of the fixed probe batch (`flywheel.probe.probe_sequences`) under
exactly the weights it publishes; a replica that cannot read every tensor
back as the checkpoint holds it (vLLM repacks its linear layers) scores the
same sequences on its resident weights and compares.

How it is computed, so that it describes the published bytes and nothing else:
  * under the export's snapshot (the engine's lock held, the policy in eval
    mode: no dropout), so no step changes the weights in between;
  * no autocast: the matmuls run in the weights' own dtype, the output head
    and the log-softmax in float32 (`forward.token_logprobs`, the same
    log-probs the trainer trains on);
  * published in another dtype than trained (`model.publish_dtype`): the
    forward runs on the cast tensors, swapped in for the call, in that dtype;
  * LoRA published merged: the forward runs on the merged tensors themselves
    (the adapters switched off, each adapted layer's weight swapped for its
    merged tensor for the call), not on base + adapters, which differ from
    the merge by its rounding.

Cost: one forward of PROBE_SEQUENCES x PROBE_LENGTH tokens (4 x 16) per
published version, no backward; a step trains on far more tokens, forward and
backward. Measured 1.4 s on one (shared) core of the 2-core EPYC for a
SmolLM2-135M-shaped model in float32 with an earlier 4 x 64 batch (about 2 %
of a quickstart step), and 4 x 16 costs less; the export runs it beside the
encoding or the broadcast (`export._snapshot`), so with a core or a GPU to
spare it hides behind them. Its logits are [4, 16, vocab] float32 (13 MB for
a 49k vocabulary), freed when it ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from flywheel.probe import ProbeBatch, probe_sequences
from services.trainer.forward import token_logprobs
from services.trainer.policy import Policy


def probe_token_ids(policy: Policy) -> list[list[int]]:
    """The probe batch's token ids for `policy`'s model: drawn below the smaller of its embedding rows
    and its tokenizer's vocabulary (embeddings are often padded past it, and an inference engine
    refuses a prompt id its tokenizer does not know)."""
    vocab = policy.vocab_size
    if policy.tokenizer is not None:
        vocab = min(vocab, len(policy.tokenizer))
    return probe_sequences(vocab)


def probe_logprobs(model: nn.Module, token_ids: Sequence[Sequence[int]], device: torch.device) -> list[list[float]]:
    """log p(ids[i + 1] | ids[:i + 1]) of each sequence under `model` as it is (float32, no autocast)."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), autocast=None)
    return logprobs[:, 1:].cpu().tolist()  # position 0 has no log-prob


class _Scored(nn.Module):
    """`token_logprobs` of the wrapped model as a forward, so `functional_call` can swap its tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return token_logprobs(self.model, ids, torch.ones_like(ids), autocast=None)[0]


def _merged_logprobs(policy: Policy, merged: Mapping[str, Tensor], token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
    """The log-probs under the merged LoRA weights `merged` (HF names, `Policy.hf_state_dict`)."""
    base = policy.hf_model
    # The merged tensors under the names of the base model's own parameters (".base_layer." in adapted layers).
    swapped = {key: merged[key.replace(".base_layer.", ".")] for key in base.state_dict()
               if "lora_" not in key and key.replace(".base_layer.", ".") in merged}
    with policy.model.disable_adapter():
        return swapped_logprobs(base, swapped, token_ids, policy.device)


def published_probe(policy: Policy, state: Mapping[str, Tensor], merge_lora: bool) -> ProbeBatch:
    """The probe of the weights an unsharded export publishes (`state`, from `export.export_state`);
    call it under the export's snapshot (lock held, eval mode)."""
    ids = probe_token_ids(policy)
    if policy.lora and merge_lora:
        return ProbeBatch.of(ids, _merged_logprobs(policy, state, ids))
    if not policy.lora and _cast(policy.model, state):
        # Published in another dtype than trained (model.publish_dtype): the forward of the cast tensors, in
        # that dtype, as a replica serving them computes. SmolLM2 under vLLM in bfloat16 on a CPU: 0.15-0.34
        # nats from this, 0.43 from the float32 forward of the same values (vLLM rounds as torch does here).
        return ProbeBatch.of(ids, swapped_logprobs(policy.model, state, ids, policy.device))
    # Without LoRA the state is the live parameters; LoRA unmerged publishes adapters that are served on top
    # of the base, as the live model computes.
    return ProbeBatch.of(ids, probe_logprobs(policy.model, ids, policy.device))


def _cast(model: nn.Module, state: Mapping[str, Tensor]) -> bool:
    """Whether `state` (the model's own names) holds tensors of another dtype than the model's."""
    return any(name in state and state[name].dtype != tensor.dtype for name, tensor in model.state_dict().items())


def swapped_logprobs(model: nn.Module, state: Mapping[str, Tensor], token_ids: Sequence[Sequence[int]],
                      device: torch.device) -> list[list[float]]:
    """The log-probs of `model` with its tensors replaced by `state`'s for the call (a tied duplicate left
    out of `state` follows the tensor it is tied to)."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    swapped = {f"model.{name}": tensor for name, tensor in state.items()}
    with torch.no_grad():
        logprobs = torch.func.functional_call(_Scored(model), swapped, (ids,), strict=False, tie_weights=True)
    return logprobs[:, 1:].cpu().tolist()
