"""Where the bearer token comes from, for servers and clients alike.

Order: an explicit value, then a token file, then env FLYWHEEL_AUTH_TOKEN,
then env FLYWHEEL_AUTH_TOKEN_FILE. No token at all means auth is off (local
development); servers log a warning when that happens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from flywheel.errors import InvalidArgument

TOKEN_ENV = "FLYWHEEL_AUTH_TOKEN"
TOKEN_FILE_ENV = "FLYWHEEL_AUTH_TOKEN_FILE"


def _read_token_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise InvalidArgument(f"auth token file {path}: {exc.strerror}") from None
    if not token:
        raise InvalidArgument(f"auth token file {path} is empty")
    return token


def resolve_token(
    token: str | None = None, token_file: Path | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    env = os.environ if env is None else env
    if token:
        return token
    if token_file is not None:
        return _read_token_file(Path(token_file))
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    if env.get(TOKEN_FILE_ENV):
        return _read_token_file(Path(env[TOKEN_FILE_ENV]))
    return None
