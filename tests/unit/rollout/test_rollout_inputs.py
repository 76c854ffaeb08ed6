"""Sampling parameters, prompts and chat messages: accepted values and errors naming the field."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from flywheel.common.v1 import common_pb2
from flywheel.errors import InvalidArgument
from flywheel.rollout.v1 import rollout_pb2 as pb
from services.rollout.serving.prompts import ChatPrompt, TextPrompt, TokenPrompt, resolve, validate_messages
from flywheel.runtime.proto_utf8 import find_invalid_utf8
from services.rollout.serving.sampling import from_proto, make_spec


def test_proto_zeros_mean_defaults() -> None:
    spec = from_proto(common_pb2.SamplingParams(max_tokens=8), max_top_logprobs=20)
    assert (spec.n, spec.temperature, spec.top_p, spec.top_k, spec.repetition_penalty, spec.seed) == (1, 0.0, 1.0, -1, 1.0, None)
    seeded = from_proto(common_pb2.SamplingParams(max_tokens=8, seed=0, temperature=1, n=3, stop=["\n"]), max_top_logprobs=20)
    assert seeded.seed == 0 and seeded.n == 3 and seeded.stop == ("\n",)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"max_tokens": -3}, "sampling.max_tokens"),
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": -5}, "sampling.top_k"),
        ({"n": 0}, "sampling.n"),
        ({"n": 2, "temperature": 0.0}, "sampling.n"),
        ({"top_logprobs": 50}, "sampling.top_logprobs"),
        ({"stop": [""]}, "sampling.stop[0]"),
        ({"min_tokens": 9, "max_tokens": 4}, "sampling.min_tokens"),
        ({"repetition_penalty": -1.0}, "sampling.repetition_penalty"),
    ],
)
def test_bad_sampling_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        make_spec(field="sampling.", max_top_logprobs=20, **{"max_tokens": 8, "temperature": 1.0, **kwargs})
    assert str(info.value).startswith(field + ":"), str(info.value)


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "hi", "mood": "happy"}], "messages[0]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                                            "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
         "messages[1].tool_calls[0].function.arguments"),
        (["hello"], "messages[0]"),
        ([{"role": "user", "content": "bad \udcff surrogate"}], "messages[0].content"),
    ],
)
def test_malformed_messages_name_the_field(messages: list, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_messages(messages)
    assert str(info.value).startswith(field + ":"), str(info.value)


def test_prompts_resolve_and_are_checked(codec) -> None:
    kw = dict(vocab_size=1000, max_model_len=32)
    assert resolve(TokenPrompt([5, 6]), codec, field="prompts[0]", **kw).ids == [5, 6]
    text = resolve(TextPrompt("What is 2 + 3?"), codec, field="prompts[0]", **kw)
    assert text.ids == codec.encode("What is 2 + 3?")
    chat = resolve(ChatPrompt([{"role": "user", "content": "hi"}]), codec, field="prompts[1]", **kw)
    assert codec.decode(chat.ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cases = [
        (TokenPrompt([]), "prompts[0].token_ids: empty prompt"),
        (TokenPrompt([1, 5000]), "prompts[0].token_ids[1]: token id 5000"),
        (TextPrompt(""), "prompts[0].text: empty prompt"),
        (TextPrompt("\ud800"), "prompts[0].text: not valid UTF-8"),
        (TokenPrompt(list(range(32))), "prompts[0].token_ids: the prompt is 32 tokens"),
        (ChatPrompt([{"role": "user", "content": "hi"}], tools=[{"type": "function"}]), "prompts[0].tools[0].function.name"),
    ]
    for prompt, message in cases:
        with pytest.raises(InvalidArgument) as info:
            resolve(prompt, codec, field="prompts[0]", **kw)
        assert str(info.value).startswith(message), str(info.value)


def test_invalid_utf8_is_located_in_the_raw_message() -> None:
    good = pb.GenerateRequest(prompts=[pb.Prompt(text="fine"), pb.Prompt(text="MARK")]).SerializeToString()
    bad = good.replace(b"MARK", b"M\xffRK")
    with pytest.raises(DecodeError):
        pb.GenerateRequest.FromString(bad)
    assert find_invalid_utf8(pb.GenerateRequest.DESCRIPTOR, bad) == "prompts[1].text"
    nested = pb.GenerateRequest(prompts=[pb.Prompt(messages=pb.ChatMessages(
        messages=[common_pb2.ChatMessage(role="user", content="MARK")]))]).SerializeToString()
    assert find_invalid_utf8(pb.GenerateRequest.DESCRIPTOR, nested.replace(b"MARK", b"\xc3(AB")) == \
        "prompts[0].messages.messages[0].content"
    assert find_invalid_utf8(pb.GenerateRequest.DESCRIPTOR, good) is None
