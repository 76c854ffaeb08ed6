"""The served model's tokenizer: text and chat messages to token ids and back.

Prompts are tokenized here, before they reach an engine, so the ids the
engine generates from are exactly the ids reported to the caller (RL must
never re-tokenize text). Both engines load the same tokenizer files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flywheel.errors import InvalidArgument


class TextCodec:
    """Wraps a Hugging Face tokenizer; every method is cheap and synchronous."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    @classmethod
    def load(cls, path: str | Path) -> TextCodec:
        from transformers import AutoTokenizer  # heavy: imported when a model is served

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True, field: str = "messages",
    ) -> str:
        """The prompt text the chat template makes of the messages."""
        if not self.has_chat_template:
            raise InvalidArgument(f"{field}: the served model has no chat template; send text or token ids")
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, tokenize=False,
            )
        except Exception as exc:  # noqa: BLE001 - jinja raises anything on bad input
            raise InvalidArgument(f"{field}: the chat template rejected the messages: {exc}") from None

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True, field: str = "messages",
    ) -> list[int]:
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, field=field)
        # The template already wrote every special token it wants.
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token as OpenAI log-prob entries show it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
