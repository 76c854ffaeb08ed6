"""The cookbook's on-policy distillation loop (`tinker_cookbook.distillation.train_on_policy.main`,
unmodified) on a local prompts file, as a user without hub access runs it: the recipe's data sets come
from a hub, so this gives it a prompt-only data set builder over a local file (the cookbook's own
PromptOnlyDataset) and a teacher checkpoint (a `tinker://` path saved for the sampler: made here first,
a LoRA model two supervised steps away from the base, as a user's earlier run would have left one).

    python tests/integration/tinker_distillation.py BASE_URL MODEL LOG_PATH PROMPTS_JSONL MAX_STEPS

The key is the SDK's own: TINKER_API_KEY in the environment."""

from __future__ import annotations

import asyncio
import json
import sys

import chz
import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
from tinker_cookbook.rl.types import RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer


@chz.chz
class LocalPrompts(RLDatasetBuilder):
    """Prompts from a JSON lines file ({"prompt": ...} a line), as the cookbook's PromptOnlyDataset."""

    path: str
    groups_per_batch: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self) -> tuple[PromptOnlyDataset, None]:
        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
        with open(self.path) as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
        return PromptOnlyDataset(prompts, self.groups_per_batch, self.group_size, renderer, tokenizer,
                                 max_prompt_tokens=None, dataset_name="local"), None


def teacher_checkpoint(url: str, model: str) -> str:
    """Weights saved for the sampler, two supervised steps from the base model: the teacher."""
    service = tinker.ServiceClient(base_url=url)
    training = service.create_lora_training_client(base_model=model, rank=32).result(120)
    data = [types.Datum(model_input=types.ModelInput.from_ints([11, 42, 77, 23]),
                        loss_fn_inputs={"target_tokens": [42, 77, 23, 5], "weights": [0.0, 1.0, 1.0, 1.0]})]
    for _ in range(2):
        training.forward_backward(data, "cross_entropy").result(120)
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result(120)
    path = training.save_weights_for_sampler("teacher").result(120).path
    service.close("success").result(60)
    return path


def main() -> None:
    url, model, log_path, prompts, max_steps = sys.argv[1:6]
    teacher = teacher_checkpoint(url, model)
    print(f"teacher checkpoint: {teacher}", flush=True)
    builder = LocalPrompts(path=prompts, groups_per_batch=2, group_size=2, model_name_for_tokenizer=model,
                           renderer_name="role_colon")
    asyncio.run(train_on_policy.main(train_on_policy.Config(
        learning_rate=1e-4, model_name=model, recipe_name="distillation", renderer_name="role_colon", max_tokens=6,
        dataset_configs=[DistillationDatasetConfig(
            dataset_builder=builder, teacher_config=TeacherConfig(base_model=model, load_checkpoint_path=teacher),
            groups_per_batch=2)],
        log_path=log_path, base_url=url, max_steps=int(max_steps), eval_every=0, save_every=0,
    )))


if __name__ == "__main__":
    main()
