"""Agent sessions: lifetime, keys, lost-after-restart, and the token-exact
continuation of a conversation from an earlier answer's own ids."""

from __future__ import annotations

import pytest

from flywheel.errors import NotFound, ResourceExhausted, Unauthenticated
from services.rollout.openai_api.sessions import CallRecord, SessionGone, SessionStore, continued_prompt


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_session_expires_after_its_ttl_unused_and_is_then_reported_gone() -> None:
    clock = Clock()
    store = SessionStore(default_ttl_seconds=10, max_open=8, clock=clock)
    session = store.open()
    clock.now += 9
    assert store.get(session.id) is session  # use pushes the expiry back
    clock.now += 9
    assert store.get(session.id) is session
    clock.now += 11
    with pytest.raises(SessionGone, match="expired after 10 s"):
        store.get(session.id)
    assert len(store) == 0


def test_an_id_from_before_a_restart_is_lost_and_an_unknown_id_is_not_found() -> None:
    before = SessionStore(default_ttl_seconds=10, max_open=8).open()
    after_restart = SessionStore(default_ttl_seconds=10, max_open=8)
    with pytest.raises(SessionGone, match="before this rollout restarted"):
        after_restart.get(before.id)
    with pytest.raises(NotFound) as info:
        after_restart.get("nonsense")
    assert not isinstance(info.value, SessionGone)


def test_a_key_opens_only_its_own_session() -> None:
    store = SessionStore(default_ttl_seconds=10, max_open=8)
    a, b = store.open(), store.open()
    assert store.authorize(a.id, f"Bearer {a.key}") is a
    for wrong in (f"Bearer {b.key}", "", a.key, "Bearer "):
        with pytest.raises(Unauthenticated):
            store.authorize(a.id, wrong)
    store.delete(a.id)
    with pytest.raises(SessionGone, match="deleted"):
        store.authorize(a.id, f"Bearer {a.key}")


def test_open_sessions_are_bounded() -> None:
    store = SessionStore(default_ttl_seconds=10, max_open=2)
    store.open(), store.open()
    with pytest.raises(ResourceExhausted, match="sessions.max_open"):
        store.open()


def _end_of_turn(codec) -> int:
    """The token a chat model stops its turn with (ChatML's, as the tiny models' template writes it)."""
    return codec.tokenizer.convert_tokens_to_ids("<|im_end|>")


def _answered(codec, session, messages, completion_text, *, tool_calls=None, stop_token=True):
    """Records an answer as the engine would have produced it; returns the reply the agent saw."""
    prompt_ids = continued_prompt(session, messages, None, codec) or codec.encode_chat(messages)
    completion = codec.encode(completion_text) + ([_end_of_turn(codec)] if stop_token else [])
    reply = {"role": "assistant", "content": completion_text}
    if tool_calls:
        reply["tool_calls"] = tool_calls
    session.calls.append(CallRecord(
        api="chat.completions", prompt_ids=prompt_ids, completion_ids=completion, logprobs=[-1.0] * len(completion),
        version_start=0, version_end=0, finish_reason="stop", text=completion_text, replica="r",
        messages=messages, tools=None, reply=reply,
    ))
    return prompt_ids, completion, reply


def test_a_conversation_sent_back_unchanged_continues_from_the_answer_own_ids(codec) -> None:
    session = SessionStore(default_ttl_seconds=10, max_open=8).open()
    first = [{"role": "user", "content": "What is 2+3?"}]
    prompt, completion, reply = _answered(codec, session, first, "It is 5.")
    # The model's ids are not what re-tokenizing its text gives: the continuation must use the ids.
    session.calls[-1].completion_ids = completion = [*codec.encode("It"), *codec.encode(" is 5."), _end_of_turn(codec)]
    second = [*first, {"role": "assistant", "content": "It is 5."}, {"role": "user", "content": "And 5+5?"}]
    ids = continued_prompt(session, second, None, codec)
    assert ids is not None
    assert ids[: len(prompt) + len(completion)] == prompt + completion
    # What follows the answer is what the template puts there: the same text a fresh rendering has.
    fresh_text = codec.render_chat(second)
    assert codec.decode(ids, skip_special_tokens=False) == fresh_text


def test_an_answer_cut_before_its_end_token_gets_the_template_end_of_turn(codec) -> None:
    session = SessionStore(default_ttl_seconds=10, max_open=8).open()
    first = [{"role": "user", "content": "Count."}]
    prompt, completion, _ = _answered(codec, session, first, "one two", stop_token=False)
    second = [*first, {"role": "assistant", "content": "one two"}, {"role": "user", "content": "More."}]
    ids = continued_prompt(session, second, None, codec)
    assert ids[: len(prompt) + len(completion)] == prompt + completion
    assert codec.decode(ids, skip_special_tokens=False) == codec.render_chat(second)


def test_edited_history_or_another_answer_starts_afresh(codec) -> None:
    session = SessionStore(default_ttl_seconds=10, max_open=8).open()
    first = [{"role": "user", "content": "What is 2+3?"}]
    _answered(codec, session, first, "It is 5.")
    edited = [*first, {"role": "assistant", "content": "It is six."}, {"role": "user", "content": "Sure?"}]
    assert continued_prompt(session, edited, None, codec) is None
    other_question = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "It is 5."}]
    assert continued_prompt(session, other_question, None, codec) is None
    assert continued_prompt(session, first, None, codec) is None  # a retry of the same question
