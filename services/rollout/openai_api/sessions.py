"""Agent sessions: one episode of an external agent, recorded token-exact.

The controller opens a session (`POST /v1/sessions`, service token) and hands
the agent a base URL scoped to it (`/sessions/{id}/v1`) and a key that is
valid for that path only. Every generation made through it is recorded as a
`CallRecord`: prompt ids, completion ids, log-probs, the weight versions of
the first and last token and this replica's name. The controller reads the
records back and rebuilds the trajectory from ids; nobody re-tokenizes text.

Token-exact continuation: when an agent sends a conversation back with an
earlier answer of this session unchanged (the usual tool loop), the next
prompt is that call's own prompt ids + completion ids + the tokens of what
the chat template adds after them. The model then continues from exactly what
it sampled (re-rendering its text could tokenize differently), and each turn
extends the previous one, so the controller merges them into one sequence.
A conversation that does not extend an earlier answer (edited history, a
template that rewrites old turns) is tokenized afresh: a new segment.

Lifetime: a session is open until the agent (or the controller) finishes it
with a reward, and its records are kept until the controller deletes them or
the session expires (`ttl_seconds` after its last use). Records live in this
process: after a restart an old session id is answered 410 "lost", never
with empty or someone else's records; an expired one, 410 "expired".
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flywheel.common.kept import KeptSet
from flywheel.models.moe import routing_json
from flywheel.common.provenance import VersionSpan
from flywheel.common.types import RAW, SampledDistribution
from flywheel.errors import InvalidArgument, NotFound, ResourceExhausted, Unauthenticated

#: Ids of expired or deleted sessions remembered to answer "expired" instead of "unknown".
_TOMBSTONES = 10_000


class SessionGone(NotFound):
    """The session existed but its records are gone (expired, or this rollout restarted)."""

    http_status = 410


@dataclass
class CallRecord:
    """One generation made through a session (one choice; sessions generate n=1)."""

    api: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version_start: int
    version_end: int
    finish_reason: str
    text: str
    replica: str
    #: The distribution `logprobs` are of (the sampling contract).
    distribution: SampledDistribution = RAW
    #: The chat request's messages (normalised) and the assistant message
    #: returned: what a later request must repeat to continue token-exact.
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    reply: dict[str, Any] | None = None
    #: Responses API: the response's id (`previous_response_id` resolves to it).
    response_id: str = ""
    #: The version that produced each completion token, as spans (flywheel.common.provenance).
    version_spans: list[VersionSpan] = field(default_factory=list)
    #: The sampler's kept set where a cut or a grammar applied (flywheel.common.kept).
    kept_sets: list[KeptSet] = field(default_factory=list)
    #: A mixture-of-experts model's routing of every token fed ([prompt + completion - 1, L, K]; flywheel.models.moe).
    routed_experts: Any = None

    def to_json(self) -> dict[str, Any]:
        return {
            "api": self.api, "prompt_token_ids": self.prompt_ids, "completion_token_ids": self.completion_ids,
            "logprobs": self.logprobs, "version_start": self.version_start, "version_end": self.version_end,
            "version_spans": [list(span) for span in self.version_spans],
            "kept_sets": [{"position": k.position, "size": k.size, "token_ids": list(k.token_ids),
                           "constrained": k.constrained} for k in self.kept_sets],
            **({} if self.routed_experts is None else {"routed_experts": routing_json(self.routed_experts)}),
            "finish_reason": self.finish_reason, "replica": self.replica, "text": self.text,
            "logprobs_distribution": {"temperature": self.distribution.temperature, "top_k": self.distribution.top_k,
                                      "top_p": self.distribution.top_p, "penalised": self.distribution.penalised},
        }


@dataclass
class Session:
    id: str
    key: str
    ttl_seconds: float
    expires_at: float
    metadata: dict[str, str] = field(default_factory=dict)
    state: str = "open"
    reward: float | None = None
    calls: list[CallRecord] = field(default_factory=list)
    #: The run step the episode's generations count for, and the least weight version they
    #: need (metadata "run_step", "min_weight_version"): paced like the controller's Generate.
    run_step: int = 0
    min_version: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "reward": self.reward, "metadata": self.metadata,
                "calls": [c.to_json() for c in self.calls]}

    def find_response(self, response_id: str) -> CallRecord:
        for call in reversed(self.calls):
            if call.response_id == response_id:
                return call
        raise NotFound(f"previous_response_id: {response_id!r} is not a response of this session")


def _count(metadata: dict[str, str], key: str) -> int:
    value = metadata.get(key, "0")
    if not value.isdigit():
        raise InvalidArgument(f"metadata.{key}: must be a whole number >= 0, got {value!r}")
    return int(value)


def pace(session: Session | None) -> dict[str, int]:
    """The core's generate arguments that pace a session's calls like the controller's Generate
    (services.rollout.weights.follower); none outside sessions."""
    return {"run_step": session.run_step, "min_version": session.min_version} if session is not None else {}


class SessionStore:
    def __init__(self, *, default_ttl_seconds: float, max_open: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.default_ttl_seconds = default_ttl_seconds
        self.max_open = max_open
        self._clock = clock
        #: Session ids start with it: an id from before a restart is told apart from a typo.
        self.boot = uuid.uuid4().hex[:8]
        self._sessions: dict[str, Session] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, ttl_seconds: float | None = None, metadata: dict[str, str] | None = None) -> Session:
        self.sweep()
        if len(self._sessions) >= self.max_open:
            raise ResourceExhausted(
                f"{len(self._sessions)} sessions are open, the most this rollout keeps (sessions.max_open); "
                "finish or delete some")
        ttl = ttl_seconds or self.default_ttl_seconds
        metadata = dict(metadata or {})
        session = Session(
            id=f"{self.boot}-{uuid.uuid4().hex[:16]}", key=f"fw-session-{secrets.token_urlsafe(24)}",
            ttl_seconds=ttl, expires_at=self._clock() + ttl, metadata=metadata,
            run_step=_count(metadata, "run_step"), min_version=_count(metadata, "min_weight_version"),
        )
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The live session (its expiry pushed back: it is in use); NotFound or SessionGone otherwise."""
        self.sweep()
        session = self._sessions.get(session_id)
        if session is not None:
            session.expires_at = self._clock() + session.ttl_seconds
            return session
        if session_id in self._gone:
            raise SessionGone(f"session {session_id}: {self._gone[session_id]}; its records are gone")
        if not session_id.startswith(f"{self.boot}-") and "-" in session_id:
            raise SessionGone(f"session {session_id} was opened before this rollout restarted; its records are lost")
        raise NotFound(f"session {session_id!r} does not exist")

    def authorize(self, session_id: str, given: str) -> Session:
        """The session whose key `given` is; one failure message for unknown ids and wrong keys."""
        session = self._sessions.get(session_id)
        expected = session.key if session is not None else secrets.token_urlsafe(24)
        if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
            if session is None:
                # A valid-looking request for a gone session learns it is gone, nothing more.
                self.get(session_id)
            raise Unauthenticated("missing or wrong session key (each session's endpoints take only its own key)")
        return self.get(session_id)

    def finish(self, session_id: str, reward: float | None) -> Session:
        session = self.get(session_id)
        session.state, session.reward = "finished", reward
        return session

    def delete(self, session_id: str) -> None:
        self.get(session_id)
        self._forget(session_id, "deleted")

    def sweep(self) -> None:
        now = self._clock()
        for session in [s for s in self._sessions.values() if s.expires_at <= now]:
            self._forget(session.id, f"expired after {session.ttl_seconds:g} s unused")

    def _forget(self, session_id: str, why: str) -> None:
        self._sessions.pop(session_id, None)
        self._gone[session_id] = why
        while len(self._gone) > _TOMBSTONES:
            self._gone.popitem(last=False)


# -- token-exact continuation -------------------------------------------------

_SENTINEL = "\u2063FLYWHEEL-CONTENT\u2063"


def _canonical(message: dict[str, Any]) -> str:
    """A message compared by meaning: tool-call arguments parsed, call ids and empty content ignored."""
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", {})
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append([fn.get("name"), args])
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content)
    return json.dumps([message.get("role"), (content or "").strip(), calls], sort_keys=True)


def _earlier_answer(session: Session, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None) -> tuple[CallRecord, int] | None:
    """The latest call whose conversation + answer `messages` starts with, and where its answer sits."""
    for call in reversed(session.calls):
        if call.messages is None or call.reply is None or call.finish_reason not in ("stop", "length"):
            continue
        at = len(call.messages)
        if len(messages) <= at or call.tools != tools:
            continue
        if all(_canonical(a) == _canonical(b) for a, b in zip(call.messages, messages)) and \
                _canonical(messages[at]) == _canonical(call.reply):
            return call, at
    return None


def continued_prompt(session: Session, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     codec: Any) -> list[int] | None:
    """Prompt ids that continue an earlier answer of the session token-exact, or None (tokenize afresh).

    `codec` is the served model's TextCodec; `messages` are validated and normalised."""
    found = _earlier_answer(session, messages, tools)
    if found is None:
        return None
    call, at = found
    render = codec.render_chat
    full = render(messages, tools=tools, add_generation_prompt=True)
    head = render(messages[: at + 1], tools=tools, add_generation_prompt=False)
    asked = render(call.messages, tools=tools, add_generation_prompt=True)
    answered = render([*call.messages, {"role": "assistant", "content": _SENTINEL}], tools=tools,
                      add_generation_prompt=False)
    # Append-only templates only: one that rewrites earlier turns (or puts
    # anything between the generation prompt and the answer) is tokenized afresh.
    if not full.startswith(head) or not answered.startswith(asked + _SENTINEL):
        return None
    after_answer = answered[len(asked) + len(_SENTINEL):]
    generated = codec.decode(call.completion_ids, skip_special_tokens=False)
    # The completion may already hold the start of it (the end-of-turn token it stopped on).
    overlap = next(k for k in range(len(after_answer), -1, -1) if generated.endswith(after_answer[:k]))
    glue = after_answer[overlap:] + full[len(head):]
    return [*call.prompt_ids, *call.completion_ids, *codec.encode(glue, add_special_tokens=False)]
