"""The rollout's domain core and generation: admission, the update gate and
weight versions (`core`), prompts in their three forms, sampling parameters
from either transport, and the served model's tokenizer."""
