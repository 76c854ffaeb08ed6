"""Bearer tokens and their scopes, for servers and clients alike.

Four scopes, each allowed what the one below it is, and more:

- `viewer`: read-only: the controller's status page and its JSON, /metrics;
- `agent`: generation, tokenize and the rollout's session endpoints;
- `service`: what the services call on each other (register, heartbeats,
  weights, training steps...);
- `operator`: everything (starting and stopping runs included).

Which scope a method needs is declared by the service that serves it
(`ServiceSpec.method_scopes`); a method it does not name needs `operator`,
so a new RPC is closed until someone decides otherwise.

Where tokens come from:

- `server.tokens_file` (else env FLYWHEEL_TOKENS_FILE): YAML mapping each
  scope to a token or a list of tokens (a list lets a token be rotated), e.g.
  `{agent: [a1, a2], service: s1, operator: o1}`; in Kubernetes, a Secret key
  mounted as a file. `python -m flywheel.runtime.tokens init FILE` writes one
  with a fresh token per scope (what the shipped deployments run on);
- the single token of earlier releases, `server.auth_token` /
  `server.auth_token_file` (else env FLYWHEEL_AUTH_TOKEN, then
  FLYWHEEL_AUTH_TOKEN_FILE), which keeps meaning what it meant: everything,
  i.e. scope `operator`.

No token at all means auth is off (local development); servers log a warning
when that happens. Tokens themselves are never logged: `TokenScopes` shows
only how many tokens each scope has.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from flywheel.errors import InvalidArgument, PermissionDenied, Unauthenticated

if TYPE_CHECKING:
    from flywheel.runtime.server_config import ServerConfig

TOKEN_ENV = "FLYWHEEL_AUTH_TOKEN"
TOKEN_FILE_ENV = "FLYWHEEL_AUTH_TOKEN_FILE"
TOKENS_FILE_ENV = "FLYWHEEL_TOKENS_FILE"


class Scope(IntEnum):
    """A token's scope; a larger one may do everything a smaller one may."""

    VIEWER = 1
    AGENT = 2
    SERVICE = 3
    OPERATOR = 4

    def __str__(self) -> str:
        return self.name.lower()

    def sufficient(self) -> str:
        """The scopes that satisfy this one, as a refusal names them: "service or operator"."""
        return " or ".join(str(s) for s in Scope if s >= self)


def refusal(method: str, needed: Scope, held: Scope) -> str:
    """The PERMISSION_DENIED message (gRPC) or 403 body (HTTP) for a token of scope `held`."""
    return f"{method} needs scope {needed.sufficient()}; this token has scope {held}"


@dataclass(frozen=True, repr=False)
class TokenScopes:
    """The tokens a server accepts, each with its scope."""

    #: (b"Bearer <token>", scope): the header value a client sends, ready to compare.
    headers: tuple[tuple[bytes, Scope], ...] = ()

    @classmethod
    def of(cls, tokens: Mapping[Scope, list[str]]) -> TokenScopes:
        return cls(tuple((f"Bearer {token}".encode(), scope) for scope, listed in tokens.items() for token in listed))

    def __bool__(self) -> bool:
        return bool(self.headers)

    def __repr__(self) -> str:
        counts = {str(s): sum(1 for _, held in self.headers if held == s) for s in Scope}
        return f"TokenScopes({counts})"

    def scope_of(self, authorization: str | bytes | None) -> Scope | None:
        """The scope of an `authorization` header's token, None if it is none of ours.

        Every token is compared, in constant time each, whatever matched before:
        how long this takes says nothing about which token (or how much of one) matched."""
        given = authorization.encode() if isinstance(authorization, str) else (authorization or b"")
        found: Scope | None = None
        for header, scope in self.headers:
            if hmac.compare_digest(given, header) and found is None:
                found = scope
        return found

    def admit(self, authorization: str | bytes | None, needed: Scope, what: str) -> Scope:
        """The scope of `authorization`'s token if it may do `what` (which needs `needed`).
        No or an unknown token: Unauthenticated; too small a scope: PermissionDenied, naming
        the scope needed (HTTP 401 and 403, gRPC UNAUTHENTICATED and PERMISSION_DENIED)."""
        held = self.scope_of(authorization)
        if held is None:
            raise Unauthenticated("missing or wrong bearer token")
        if held < needed:
            raise PermissionDenied(refusal(what, needed, held))
        return held


def _read_token_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise InvalidArgument(f"auth token file {path}: {exc.strerror}") from None
    if not token:
        raise InvalidArgument(f"auth token file {path} is empty")
    return token


def read_tokens_file(path: Path) -> dict[Scope, list[str]]:
    """A tokens file's tokens by scope. Errors name the file and the entry, never a token."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidArgument(f"tokens file {path}: {exc.strerror}") from None
    return parse_tokens(text, path)


def parse_tokens(text: str, path: Path | str) -> dict[Scope, list[str]]:
    """A tokens file's text (from `path`, which errors name) as tokens by scope."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        raise InvalidArgument(f"tokens file {path}: not YAML") from None
    if not isinstance(data, Mapping) or not data:
        raise InvalidArgument(f"tokens file {path}: expected a mapping of scope to token(s), e.g. 'agent: <token>'")
    tokens: dict[Scope, list[str]] = {}
    for name, value in data.items():
        try:
            scope = Scope[str(name).upper()]
        except KeyError:
            raise InvalidArgument(
                f"tokens file {path}: unknown scope {name!r}; scopes are {', '.join(str(s) for s in Scope)}"
            ) from None
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) and v.strip() for v in values):
            raise InvalidArgument(f"tokens file {path}: {name}: each token must be a non-empty string")
        tokens[scope] = [v.strip() for v in values]
    return tokens


def resolve_token(
    token: str | None = None, token_file: Path | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """The token a client sends: an explicit value, a token file, env FLYWHEEL_AUTH_TOKEN,
    env FLYWHEEL_AUTH_TOKEN_FILE, then the `service` token of env FLYWHEEL_TOKENS_FILE."""
    env = os.environ if env is None else env
    if token:
        return token
    if token_file is not None:
        return _read_token_file(Path(token_file))
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    if env.get(TOKEN_FILE_ENV):
        return _read_token_file(Path(env[TOKEN_FILE_ENV]))
    if env.get(TOKENS_FILE_ENV):
        service = read_tokens_file(Path(env[TOKENS_FILE_ENV])).get(Scope.SERVICE)
        return service[0] if service else None
    return None


def _legacy_token(server: ServerConfig, env: Mapping[str, str]) -> str | None:
    """The single-token setting of earlier releases (scope operator)."""
    value = server.auth_token.get_secret_value() if server.auth_token else None
    if value:
        return value
    if server.auth_token_file is not None:
        return _read_token_file(Path(server.auth_token_file))
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    if env.get(TOKEN_FILE_ENV):
        return _read_token_file(Path(env[TOKEN_FILE_ENV]))
    return None


def _scoped_tokens(server: ServerConfig, env: Mapping[str, str]) -> dict[Scope, list[str]]:
    path = server.tokens_file or (Path(env[TOKENS_FILE_ENV]) if env.get(TOKENS_FILE_ENV) else None)
    return read_tokens_file(path) if path is not None else {}


def accepted_tokens(server: ServerConfig, env: Mapping[str, str] | None = None) -> TokenScopes:
    """Every token a server with this config accepts, with its scope (empty: auth off)."""
    env = os.environ if env is None else env
    scoped = _scoped_tokens(server, env)
    legacy = _legacy_token(server, env)
    if legacy:
        scoped.setdefault(Scope.OPERATOR, []).append(legacy)
    return TokenScopes.of(scoped)


def viewer_token(server: ServerConfig, env: Mapping[str, str] | None = None) -> str | None:
    """A `viewer` token of the tokens file, to hand someone who only looks (the status page's
    link); None without one: a larger scope's token is never handed out in its place."""
    viewers = _scoped_tokens(server, os.environ if env is None else env).get(Scope.VIEWER)
    return viewers[0] if viewers else None


def own_token(server: ServerConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The token a service sends when it calls the others: its `service` token, else the
    single operator token of earlier releases, else an `operator` token of its tokens file."""
    env = os.environ if env is None else env
    scoped = _scoped_tokens(server, env)
    if scoped.get(Scope.SERVICE):
        return scoped[Scope.SERVICE][0]
    legacy = _legacy_token(server, env)
    if legacy:
        return legacy
    return scoped[Scope.OPERATOR][0] if scoped.get(Scope.OPERATOR) else None
