"""A small byte-level BPE tokenizer, trained locally, and the ChatML chat template.

Flywheel's tests and local demo need a tokenizer without a model-hub download.
`build_tokenizer()` trains one with the `tokenizers` library on a built-in corpus
(arithmetic question/answer text, English sentences, chat and tool-call words),
deterministically, in well under a second, and wraps it in a
`PreTrainedTokenizerFast` so `AutoTokenizer.from_pretrained(dir)` loads it offline.

`chatml_template()` renders the ChatML-style Jinja template that both the tiny
models and the converted SmolLM2 checkpoint ship: system/user/assistant/tool
roles, `add_generation_prompt`, and `tools` listed in the system prompt with
Hermes-style `<tool_call>` blocks for assistant tool calls.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

DEFAULT_VOCAB_SIZE = 1024
DEFAULT_MAX_LENGTH = 2048

_TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to help with the user query. "
    "The available functions are listed as JSON inside <tools></tools>:\n<tools>"
)
_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nTo call a function, reply with one JSON object per call inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
)


def chatml_template(default_system: str = "") -> str:
    """Return a ChatML Jinja chat template.

    `default_system` is rendered as the system turn when the conversation does
    not start with one (SmolLM2-Instruct was trained that way); empty means no
    system turn is added. With no `tools`, the output is plain ChatML:
    `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message.
    """
    # Written with {%- -%} throughout so the template text itself adds no
    # whitespace; every newline in the output comes from a string literal.
    return "".join(
        [
            "{%- macro text(content) -%}",
            "{%- if content is none -%}",
            "{%- elif content is string -%}{{ content }}",
            # OpenAI-style content parts: keep only the text parts.
            "{%- else -%}{%- for part in content -%}"
            "{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}"
            "{%- endfor -%}",
            "{%- endif -%}",
            "{%- endmacro -%}",
            f"{{%- set default_system = {json.dumps(default_system)} -%}}",
            "{%- if messages and messages[0].role == 'system' -%}",
            "{%- set system_text = text(messages[0].content) -%}",
            "{%- set turns = messages[1:] -%}",
            "{%- else -%}",
            "{%- set system_text = default_system if messages else '' -%}",
            "{%- set turns = messages -%}",
            "{%- endif -%}",
            # The system turn is written out piecewise: a Jinja `set` inside a
            # for loop does not outlive the loop, so it cannot accumulate text.
            "{%- if system_text or tools -%}",
            "{{ '<|im_start|>system\\n' + system_text }}",
            "{%- if tools -%}",
            f"{{{{ {json.dumps(_TOOLS_PREAMBLE)} if system_text else "
            f"{json.dumps(_TOOLS_PREAMBLE.lstrip())} }}}}",
            "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}",
            f"{{{{ {json.dumps(_TOOLS_POSTAMBLE)} }}}}",
            "{%- endif -%}",
            "{{ '<|im_end|>\\n' }}",
            "{%- endif -%}",
            "{%- for message in turns -%}",
            "{{ '<|im_start|>' + message.role + '\\n' }}{{ text(message.content) }}",
            "{%- if message.role == 'assistant' and message.tool_calls -%}",
            "{%- for call in message.tool_calls -%}",
            # Accept both OpenAI's {"function": {...}} wrapper and a bare call.
            "{%- set fn = call.function if call.function is defined else call -%}",
            "{%- if loop.index > 1 or text(message.content) -%}{{ '\\n' }}{%- endif -%}",
            '{{ \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' }}',
            # OpenAI sends arguments as a JSON string; others send an object.
            "{%- if fn.arguments is string -%}{{ fn.arguments }}"
            "{%- else -%}{{ fn.arguments | tojson }}{%- endif -%}",
            "{{ '}\\n</tool_call>' }}",
            "{%- endfor -%}",
            "{%- endif -%}",
            "{{ '<|im_end|>\\n' }}",
            "{%- endfor -%}",
            "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
        ]
    )


_ENGLISH = (
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token from the tokens before it.",
    "Reinforcement learning improves a policy with rewards from its own samples.",
    "The trainer updates the weights and the rollout engine generates answers.",
    "Please think step by step and give the final answer at the end.",
    "Let me add the numbers one digit at a time and carry when needed.",
    "First we multiply, then we subtract, and finally we check the result.",
    "You are a helpful assistant that answers math questions.",
    "You are a careful assistant. Answer briefly and correctly.",
    "Sure! Here is the answer to your question.",
    "I am sorry, I do not know the answer to that question.",
    "Hello, how are you today? I am fine, thank you.",
    "The sum of two numbers is the result of adding them together.",
    "The difference is what remains when one number is taken from another.",
    "The product of two numbers is the result of multiplying them.",
    "Numbers can be even or odd, positive or negative, small or large.",
    "This is a short sentence. This is another one, with a comma.",
    "The weather is nice, so we went for a walk in the park.",
    "Count from one to ten: one, two, three, four, five, six, seven, eight, nine, ten.",
    "The user asked a question and the assistant wrote a reply.",
    "Call the calculator tool when the arithmetic is hard.",
    "The function returned a result, and the assistant used it in the answer.",
    "Correct answers earn a reward of one; wrong answers earn zero.",
)

_NAMES = ("calculator", "get_weather", "search", "python")


def _arithmetic_lines(rng: random.Random, count: int) -> Iterator[str]:
    """Arithmetic question/answer lines in a few phrasings."""
    for _ in range(count):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        op = rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        style = rng.randrange(5)
        if style == 0:
            yield f"What is {a} {op} {b}? The answer is {result}."
        elif style == 1:
            yield f"Question: Compute {a} {op} {b}.\nAnswer: {a} {op} {b} = {result}"
        elif style == 2:
            yield f"Q: {a} {op} {b} = ?\nA: {result}\n#### {result}"
        elif style == 3:
            yield f"Calculate {a} {op} {b}. Let's think step by step. So the answer is {result}."
        else:
            yield f"{a} {op} {b} = {result}"


def _chat_lines(rng: random.Random, count: int) -> Iterator[str]:
    """Chat-role and tool-call text as it appears in rendered conversations."""
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        name = rng.choice(_NAMES)
        yield f"system\nYou are a helpful assistant.\nuser\nWhat is {a} + {b}?\nassistant\n{a + b}"
        yield (
            f'<tool_call>\n{{"name": "{name}", "arguments": {{"expression": "{a} * {b}"}}}}'
            f"\n</tool_call>\ntool\n{a * b}\nassistant\nThe answer is {a * b}."
        )
        yield (
            '<tools>\n{"type": "function", "function": {"name": "'
            + name
            + '", "description": "Evaluate an expression", "parameters": '
            '{"type": "object", "properties": {"expression": {"type": "string"}}, '
            '"required": ["expression"]}}}\n</tools>'
        )


def training_corpus(seed: int = 0) -> list[str]:
    """The built-in training text; the same `seed` always gives the same list."""
    rng = random.Random(seed)
    lines = list(_ENGLISH) * 20
    lines += _arithmetic_lines(rng, 3000)
    lines += _chat_lines(rng, 300)
    return lines


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> Tokenizer:
    """Train a byte-level BPE `tokenizers.Tokenizer` on the built-in corpus."""
    tok = Tokenizer(models.BPE())
    # Single digits, as Llama 3 and Qwen do: numbers tokenize uniformly, which
    # keeps arithmetic rewards about arithmetic rather than token boundaries.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text (any language, any emoji) encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    return tok


def build_tokenizer(
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_length: int = DEFAULT_MAX_LENGTH,
    seed: int = 0,
) -> PreTrainedTokenizerFast:
    """Train the tokenizer and wrap it with special tokens and the chat template.

    `<|endoftext|>` is the eos and pad token; `<|im_start|>`/`<|im_end|>` delimit
    chat turns. There is no bos token, as in Qwen2.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, seed),
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=chatml_template(),
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(out_dir: str | Path, **kwargs: int) -> PreTrainedTokenizerFast:
    """Build the tokenizer (see `build_tokenizer`) and save it into `out_dir`."""
    tokenizer = build_tokenizer(**kwargs)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
