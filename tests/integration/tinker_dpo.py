"""The cookbook's DPO trainer (`tinker_cookbook.preference.train_dpo.main`, unmodified) on a local
comparisons file, as a user without hub access runs it: the recipe's command line takes only hub data
sets, so this builds its Config around the cookbook's own JSONL comparisons builder.

    python tests/integration/tinker_dpo.py BASE_URL MODEL LOG_PATH COMPARISONS_JSONL MAX_STEPS

The key is the SDK's own: TINKER_API_KEY in the environment."""

from __future__ import annotations

import sys

from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


def main() -> None:
    url, model, log_path, comparisons, max_steps = sys.argv[1:6]
    builder = DPODatasetBuilderFromComparisons(
        comparison_builder=ComparisonBuilderFromJsonl(train_path=comparisons),
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=model, renderer_name="role_colon", max_length=128, batch_size=4),
    )
    train_dpo.main(train_dpo.Config(
        log_path=log_path, model_name=model, recipe_name="dpo", dataset_builder=builder, renderer_name="role_colon",
        base_url=url, learning_rate=1e-4, max_steps=int(max_steps), save_every=0, eval_every=0,
        infrequent_eval_every=0,
    ))


if __name__ == "__main__":
    main()
