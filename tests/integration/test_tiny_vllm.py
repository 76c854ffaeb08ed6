"""vLLM (CPU build included) serves the tiny model exactly as transformers computes it.

RL needs the rollout engine's token ids and log-probs to be the policy's: this
checks greedy tokens match token for token, and log-probs agree, for both tiny
architectures, with settings that keep vLLM-on-CPU small and quick to start.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# In-process engine core: no engine subprocess, so start-up is quick and the
# test process owns everything it starts. vLLM reads this when it starts an engine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from flywheel.models.tiny import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_NEW_TOKENS = 12

# Small engine settings. A fixed KV-cache size matters most on CPU: the default
# (or VLLM_CPU_KVCACHE_SPACE, whole GiB only) allocates and touches a GiB or
# more at start-up; 64 MiB still holds 64k tokens of this model.
ENGINE_KWARGS = dict(
    # Explicit: with "auto", vLLM on CPU downcasts float32 checkpoints to bfloat16.
    dtype="float32",
    max_model_len=256,
    max_num_seqs=4,
    kv_cache_memory_bytes=64 * 2**20,
    enforce_eager=True,  # no torch.compile warm-up
    seed=0,
)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), arch=request.param)


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> Iterator[object]:
    engine = vllm.LLM(model=str(tiny_dir), **ENGINE_KWARGS)
    yield engine
    del engine
    gc.collect()


def _prompts(tiny_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7?"}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    return [tokenizer.encode("What is 2 + 3? The answer is"), list(chat)]


def _reference_greedy(
    tiny_dir: Path, prompt: list[int], steps: int
) -> tuple[list[int], list[float]]:
    """Greedy decoding with a full forward pass per step: the plainest reference."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            ids.append(token)
    return ids[len(prompt) :], logprobs


def test_greedy_tokens_and_logprobs_match_transformers(llm, tiny_dir: Path) -> None:
    prompts = _prompts(tiny_dir)
    params = vllm.SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=1, ignore_eos=True
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.prompt_token_ids) == prompt
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        assert len(tokens) == MAX_NEW_TOKENS
        vllm_logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)
        ]

        ref_tokens, ref_logprobs = _reference_greedy(tiny_dir, prompt, MAX_NEW_TOKENS)
        assert tokens == ref_tokens
        # Both run in float32 (measured gap ~5e-7); a bfloat16 engine would be
        # off by ~5e-3, so this also catches vLLM's CPU default of downcasting.
        assert vllm_logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        # A random model is near-uniform over the vocabulary, not degenerate.
        assert all(-10.0 < lp < -1.0 for lp in vllm_logprobs)


def test_text_prompt_uses_the_same_tokenizer(llm, tiny_dir: Path) -> None:
    text = "What is 2 + 3? The answer is"
    params = vllm.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    (output,) = llm.generate([text], params, use_tqdm=False)
    assert list(output.prompt_token_ids) == AutoTokenizer.from_pretrained(tiny_dir).encode(text)
