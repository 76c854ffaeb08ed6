"""Bearer tokens and their scopes, for servers and clients alike.

Four scopes, each allowed what the one below it is, and more:

- (`tenant`, below them all: a Tinker tenant's key. It opens no RPC and no
  HTTP route of any service but the Tinker gateway's API, which knows whose
  it is: `TokenScopes.tenant_of`. services/tinker, docs/tinker.md);
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
  `{agent: [a1, a2], service: s1, operator: o1}`, and tenant keys by tenant
  under `tenants` (`tenants: {alice: [k1, k2]}`); in Kubernetes, a Secret key
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
import re
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

    #: A Tinker tenant's key: below every method's scope (PERMISSION_DENIED everywhere but the Tinker API).
    TENANT = 0
    VIEWER = 1
    AGENT = 2
    SERVICE = 3
    OPERATOR = 4

    def __str__(self) -> str:
        return self.name.lower()

    def sufficient(self) -> str:
        """The scopes that satisfy this one, as a refusal names them: "service or operator"."""
        return " or ".join(str(s) for s in Scope if s >= self)


#: The scopes a tokens file lists tokens under; tenant keys are listed by tenant, under `tenants`.
TOKEN_SCOPES = (Scope.VIEWER, Scope.AGENT, Scope.SERVICE, Scope.OPERATOR)
#: The key of a tokens file's tenant keys, and what a tenant's name may be (a path component, a label value).
TENANTS_KEY = "tenants"
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def refusal(method: str, needed: Scope, held: Scope) -> str:
    """The PERMISSION_DENIED message (gRPC) or 403 body (HTTP) for a token of scope `held`."""
    return f"{method} needs scope {needed.sufficient()}; this token has scope {held}"


@dataclass(frozen=True, repr=False)
class TokenScopes:
    """The tokens a server accepts, each with its scope."""

    #: (b"Bearer <token>", scope): the header value a client sends, ready to compare.
    headers: tuple[tuple[bytes, Scope], ...] = ()
    #: (b"Bearer <key>", tenant): the tenant keys (scope `tenant`), each its tenant's.
    tenant_headers: tuple[tuple[bytes, str], ...] = ()

    @classmethod
    def of(cls, tokens: Mapping[Scope, list[str]], tenants: Mapping[str, list[str]] | None = None) -> TokenScopes:
        return cls(tuple((f"Bearer {token}".encode(), scope) for scope, listed in tokens.items() for token in listed),
                   tuple((f"Bearer {key}".encode(), name) for name, keys in (tenants or {}).items() for key in keys))

    def __bool__(self) -> bool:
        return bool(self.headers or self.tenant_headers)

    def __repr__(self) -> str:
        counts = {str(s): sum(1 for _, held in self.headers if held == s) for s in TOKEN_SCOPES}
        return f"TokenScopes({counts}, tenants={len({name for _, name in self.tenant_headers})})"

    def tenant_of(self, authorization: str | bytes | None) -> str | None:
        """The tenant whose key `authorization` carries; None for any other token or none
        (compared in constant time each, every key, as `scope_of` does)."""
        given = authorization.encode() if isinstance(authorization, str) else (authorization or b"")
        found: str | None = None
        for header, name in self.tenant_headers:
            if hmac.compare_digest(given, header) and found is None:
                found = name
        return found

    def scope_of(self, authorization: str | bytes | None) -> Scope | None:
        """The scope of an `authorization` header's token, None if it is none of ours.

        Every token is compared, in constant time each, whatever matched before:
        how long this takes says nothing about which token (or how much of one) matched."""
        given = authorization.encode() if isinstance(authorization, str) else (authorization or b"")
        found: Scope | None = None
        for header, scope in self.headers:
            if hmac.compare_digest(given, header) and found is None:
                found = scope
        tenant = self.tenant_of(given)
        return found if found is not None else (Scope.TENANT if tenant is not None else None)

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


def _read(path: Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise InvalidArgument(f"tokens file {path}: {exc.strerror}") from None


def read_tokens_file(path: Path) -> dict[Scope, list[str]]:
    """A tokens file's tokens by scope. Errors name the file and the entry, never a token."""
    return parse_tokens(_read(path), path)


def read_tenant_keys(path: Path) -> dict[str, list[str]]:
    """A tokens file's tenant keys by tenant (empty: none)."""
    return parse_tokens_file(_read(path), path)[1]


def parse_tokens(text: str, path: Path | str) -> dict[Scope, list[str]]:
    """A tokens file's text (from `path`, which errors name) as tokens by scope."""
    return parse_tokens_file(text, path)[0]


def _token_list(value: object, path: Path | str, entry: str) -> list[str]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, str) and v.strip() for v in values):
        raise InvalidArgument(f"tokens file {path}: {entry}: each token must be a non-empty string")
    return [v.strip() for v in values]


def parse_tokens_file(text: str, path: Path | str) -> tuple[dict[Scope, list[str]], dict[str, list[str]]]:
    """A tokens file's text as tokens by scope and tenant keys by tenant."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        raise InvalidArgument(f"tokens file {path}: not YAML") from None
    if not isinstance(data, Mapping) or not data:
        raise InvalidArgument(f"tokens file {path}: expected a mapping of scope to token(s), e.g. 'agent: <token>'")
    tokens: dict[Scope, list[str]] = {}
    tenants: dict[str, list[str]] = {}
    for name, value in data.items():
        if name == TENANTS_KEY:
            if not isinstance(value, Mapping):
                raise InvalidArgument(f"tokens file {path}: {TENANTS_KEY}: expected a mapping of tenant to key(s)")
            for tenant, keys in value.items():
                if not isinstance(tenant, str) or not TENANT_NAME.match(tenant):
                    raise InvalidArgument(f"tokens file {path}: {TENANTS_KEY}: tenant {tenant!r} must be lowercase "
                                          "letters, digits, '_' or '-' (at most 63)")
                tenants[tenant] = _token_list(keys, path, f"{TENANTS_KEY}.{tenant}")
            continue
        scope = next((s for s in TOKEN_SCOPES if str(s) == str(name)), None)
        if scope is None:
            raise InvalidArgument(
                f"tokens file {path}: unknown scope {name!r}; scopes are {', '.join(str(s) for s in TOKEN_SCOPES)} "
                f"(tenant keys go under '{TENANTS_KEY}: {{NAME: KEY}}')"
            )
        tokens[scope] = _token_list(value, path, str(name))
    return tokens, tenants


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


def tokens_file_path(server: ServerConfig, env: Mapping[str, str] | None = None) -> Path | None:
    """The tokens file a server with this config reads (`server.tokens_file`, else the env's), if any."""
    env = os.environ if env is None else env
    return server.tokens_file or (Path(env[TOKENS_FILE_ENV]) if env.get(TOKENS_FILE_ENV) else None)


def _scoped_tokens(server: ServerConfig, env: Mapping[str, str]) -> dict[Scope, list[str]]:
    path = tokens_file_path(server, env)
    return read_tokens_file(path) if path is not None else {}


def accepted_tokens(server: ServerConfig, env: Mapping[str, str] | None = None) -> TokenScopes:
    """Every token a server with this config accepts, with its scope (empty: auth off); tenant
    keys too (scope `tenant`: refused by every method, known so as to say PERMISSION_DENIED)."""
    env = os.environ if env is None else env
    path = tokens_file_path(server, env)
    scoped, tenants = parse_tokens_file(_read(path), path) if path is not None else ({}, {})
    legacy = _legacy_token(server, env)
    if legacy:
        scoped.setdefault(Scope.OPERATOR, []).append(legacy)
    return TokenScopes.of(scoped, tenants)


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
