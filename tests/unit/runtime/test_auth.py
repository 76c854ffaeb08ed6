"""Token scopes: where tokens come from, which scope each has, what a refusal says."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.errors import InvalidArgument, PermissionDenied, Unauthenticated
from flywheel.runtime.auth import Scope, TokenScopes, accepted_tokens, own_token, read_tokens_file, refusal, viewer_token
from flywheel.runtime.server_config import ServerConfig


def test_scopes_nest_and_a_refusal_names_what_would_do() -> None:
    assert Scope.VIEWER < Scope.AGENT < Scope.SERVICE < Scope.OPERATOR
    assert Scope.VIEWER  # every scope is truthy: `if held` never mistakes the lowest for none
    assert refusal("UpdateWeights", Scope.SERVICE, Scope.AGENT) == (
        "UpdateWeights needs scope service or operator; this token has scope agent")
    assert refusal("Stop", Scope.OPERATOR, Scope.SERVICE) == "Stop needs scope operator; this token has scope service"


def test_tokens_file_and_single_token_combine(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("agent: [a1, a2]\nservice: s1\n")
    config = ServerConfig(tokens_file=tokens, auth_token="legacy")
    accepted = accepted_tokens(config, env={})
    assert accepted.scope_of("Bearer a2") == Scope.AGENT
    assert accepted.scope_of("Bearer s1") == Scope.SERVICE
    assert accepted.scope_of("Bearer legacy") == Scope.OPERATOR  # what the single token always allowed
    assert accepted.scope_of("Bearer nope") is None and accepted.scope_of(None) is None
    assert own_token(config, env={}) == "s1"  # services call each other with their service token
    assert "a1" not in repr(accepted) and "s1" not in repr(accepted)


def test_env_supplies_the_tokens_file_and_without_any_token_auth_is_off(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("operator: o1\n")
    assert own_token(ServerConfig(), env={"FLYWHEEL_TOKENS_FILE": str(tokens)}) == "o1"
    assert not accepted_tokens(ServerConfig(), env={})
    assert not TokenScopes()


@pytest.mark.parametrize("text, words", [
    ("admin: x\n", "unknown scope 'admin'"),
    ("agent: ''\n", "agent: each token must be a non-empty string"),
    ("- a\n", "expected a mapping"),
])
def test_a_bad_tokens_file_is_named_without_its_tokens(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=words):
        read_tokens_file(path)


def test_a_viewer_token_is_handed_out_and_never_a_larger_one(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("viewer: [v1, v2]\nagent: a1\n")
    assert viewer_token(ServerConfig(tokens_file=tokens), env={}) == "v1"
    assert accepted_tokens(ServerConfig(tokens_file=tokens), env={}).scope_of("Bearer v2") == Scope.VIEWER
    tokens.write_text("agent: a1\nservice: s1\noperator: o1\n")
    assert viewer_token(ServerConfig(tokens_file=tokens), env={}) is None
    assert viewer_token(ServerConfig(auth_token="legacy"), env={}) is None


def test_admit_says_401_or_403_in_the_errors_it_raises() -> None:
    accepted = TokenScopes.of({Scope.AGENT: ["a1"], Scope.SERVICE: ["s1"]})
    assert accepted.admit("Bearer s1", Scope.SERVICE, "Heartbeat") == Scope.SERVICE
    with pytest.raises(Unauthenticated, match="missing or wrong bearer token"):
        accepted.admit(None, Scope.VIEWER, "GET /api/status")
    with pytest.raises(PermissionDenied, match="^Heartbeat needs scope service or operator; this token has scope agent$"):
        accepted.admit("Bearer a1", Scope.SERVICE, "Heartbeat")
