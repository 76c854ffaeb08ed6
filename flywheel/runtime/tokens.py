"""Makes the tokens file every shipped deployment runs on, and reads one token back out.

    python -m flywheel.runtime.tokens init FILE          # a fresh token per scope, unless FILE exists
    python -m flywheel.runtime.tokens init --from - FILE < tokens.yaml   # another deployment's tokens
    python -m flywheel.runtime.tokens show SCOPE [FILE]  # FILE's (default $FLYWHEEL_TOKENS_FILE) SCOPE token
    python -m flywheel.runtime.tokens tenant add NAME [FILE]      # a new Tinker key for tenant NAME, printed once
    python -m flywheel.runtime.tokens tenant list [FILE]          # tenants and their keys' first characters
    python -m flywheel.runtime.tokens tenant revoke [--key PREFIX] NAME [FILE]   # all of NAME's keys, or one

`init` writes FILE (mode 0600) with one random token for each scope of
`flywheel.runtime.auth.Scope` (viewer, agent, service, operator), in the format
`read_tokens_file` reads. It leaves an existing FILE as it is, so that the
compose init service can run at every `docker compose up` and the tokens stay
those clients already hold; `--from` copies another deployment's tokens file
instead (read from stdin with `-`, so that a container needs no host file it
could not read), for a far site that must hold the central site's tokens. `show` prints one token, for handing each client the
least it needs: agents the `agent` token, whoever looks at the status page the
`viewer` one; never the `operator` token to an agent.

`tenant` manages Tinker tenants' keys (the `tenants` entry: tenant -> keys).
A tenant key opens only the Tinker gateway's API, where everything it makes
is its tenant's; every other service refuses it (PERMISSION_DENIED). `add`
prints the new key (it is not shown again: `list` shows each key's first
characters only); `revoke` removes keys, and the gateway refuses them from
its next request on (it re-reads the file when it changes). The file is
rewritten whole (comments dropped), atomically, mode 0600, under a lock.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from flywheel.errors import InvalidArgument
from flywheel.runtime.auth import (
    TENANT_NAME, TENANTS_KEY, TOKEN_SCOPES, TOKENS_FILE_ENV, Scope, parse_tokens, parse_tokens_file, read_tokens_file,
)

#: 32 random bytes, hex: 256 bits a guesser would have to find.
TOKEN_BYTES = 32
#: Every token starts so: the Tinker SDK sends only API keys that do, and the `service`
#: token is what a Tinker client holds (services/tinker).
TOKEN_PREFIX = "tml-"


def new_tokens_yaml() -> str:
    """A tokens file's text: one fresh token per scope, lowest scope first."""
    header = "# Flywheel bearer tokens by scope (python -m flywheel.runtime.tokens); keep this file secret.\n"
    return header + "".join(f"{scope}: {new_token()}\n" for scope in TOKEN_SCOPES)


def new_token() -> str:
    return f"{TOKEN_PREFIX}{secrets.token_hex(TOKEN_BYTES)}"


#: How much of a key `tenant list` shows (the prefix and 8 hex digits: enough to tell keys apart).
SHOWN = len(TOKEN_PREFIX) + 8


@contextlib.contextmanager
def _rewriting(path: Path) -> Iterator[tuple[dict[Scope, list[str]], dict[str, list[str]]]]:
    """The file's tokens and tenant keys, to change in the block; written back (atomically, mode
    0600) when it ends without an error. A lock beside the file serialises concurrent rewrites."""
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            text = path.read_text()
        except OSError as exc:
            raise InvalidArgument(f"tokens file {path}: {exc.strerror}") from None
        scopes, tenants = parse_tokens_file(text, path)
        yield scopes, tenants
        data: dict = {str(scope): (keys[0] if len(keys) == 1 else keys) for scope, keys in scopes.items()}
        if tenants:
            data[TENANTS_KEY] = {name: keys for name, keys in sorted(tenants.items())}
        header = "# Flywheel bearer tokens by scope, and Tinker tenants' keys (python -m flywheel.runtime.tokens); " \
                 "keep this file secret.\n"
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(header + yaml.safe_dump(data, sort_keys=False))
        os.replace(tmp, path)


def add_tenant_key(path: Path, tenant: str) -> str:
    """A new key for `tenant` (made a tenant if it is none yet), added to the file at `path`."""
    if not TENANT_NAME.match(tenant):
        raise InvalidArgument(f"tenant {tenant!r}: lowercase letters, digits, '_' or '-' (at most 63), "
                              "starting with a letter or digit")
    key = new_token()
    with _rewriting(path) as (_, tenants):
        tenants.setdefault(tenant, []).append(key)
    return key


def list_tenants(path: Path) -> dict[str, list[str]]:
    """Each tenant's keys, shown by their first characters only."""
    _, tenants = parse_tokens_file(Path(path).read_text(), path)
    return {name: [f"{key[:SHOWN]}..." for key in keys] for name, keys in sorted(tenants.items())}


def revoke_tenant(path: Path, tenant: str, key_prefix: str | None = None) -> int:
    """Removes `tenant`'s keys (only those starting with `key_prefix` if given); how many went."""
    with _rewriting(path) as (_, tenants):
        keys = tenants.get(tenant)
        if keys is None:
            raise InvalidArgument(f"tokens file {path}: no tenant {tenant!r}")
        if key_prefix is not None and len(key_prefix) < SHOWN:
            raise InvalidArgument(f"--key: give at least the {SHOWN} characters `tenant list` shows")
        kept = [k for k in keys if key_prefix is not None and not k.startswith(key_prefix)]
        if len(kept) == len(keys):
            raise InvalidArgument(f"tenant {tenant!r} has no key starting with {key_prefix!r}")
        if kept:
            tenants[tenant] = kept
        else:
            del tenants[tenant]
    return len(keys) - len(kept)


def init(path: Path, text: str | None = None) -> bool:
    """Writes a tokens file at `path` unless one is there, whether it wrote one: `text`
    (another deployment's tokens, checked first), else a fresh token per scope."""
    if text is not None:
        parse_tokens(text, "--from")
    try:
        # O_EXCL: two inits racing leave one file, and an existing one is never overwritten.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        read_tokens_file(path)  # a file that is there must be one the services can read
        return False
    with os.fdopen(fd, "w") as out:
        out.write(new_tokens_yaml() if text is None else text)
    return True


def show(scope: Scope, path: Path) -> str:
    """The first token of `scope` in the tokens file at `path`."""
    listed = read_tokens_file(path).get(scope)
    if not listed:
        raise InvalidArgument(f"tokens file {path}: no {scope} token")
    return listed[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flywheel.runtime.tokens", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    init_command = commands.add_parser("init", help="write FILE with a fresh token per scope, unless it exists")
    init_command.add_argument("--from", dest="source", help="copy this tokens file instead ('-': stdin)")
    init_command.add_argument("file", type=Path)
    show_command = commands.add_parser("show", help="print one scope's token of FILE")
    show_command.add_argument("scope", choices=[str(s) for s in TOKEN_SCOPES])
    show_command.add_argument("file", type=Path, nargs="?", help=f"default ${TOKENS_FILE_ENV}")
    tenant_command = commands.add_parser("tenant", help="make, list and revoke Tinker tenants' keys")
    tenant_actions = tenant_command.add_subparsers(dest="action", required=True)
    add = tenant_actions.add_parser("add", help="a new key for tenant NAME, printed once")
    add.add_argument("name")
    listing = tenant_actions.add_parser("list", help="tenants and their keys' first characters")
    revoke = tenant_actions.add_parser("revoke", help="remove tenant NAME's keys (or one, --key)")
    revoke.add_argument("name")
    revoke.add_argument("--key", help="only the key starting so (as `tenant list` shows it, without the dots)")
    for sub in (add, listing, revoke):
        sub.add_argument("file", type=Path, nargs="?", help=f"default ${TOKENS_FILE_ENV}")
    args = parser.parse_args(argv)
    try:
        if args.command == "init":
            source = None if args.source is None else (
                sys.stdin.read() if args.source == "-" else Path(args.source).read_text())
            wrote = init(args.file, source)
            print(f"{'wrote' if wrote else 'kept the existing'} tokens file {args.file} "
                  f"(scopes {', '.join(str(s) for s in TOKEN_SCOPES)})", file=sys.stderr)
            return 0
        path = args.file or (Path(os.environ[TOKENS_FILE_ENV]) if os.environ.get(TOKENS_FILE_ENV) else None)
        if path is None:
            parser.error(f"{args.command}: give FILE or set {TOKENS_FILE_ENV}")
        if args.command == "show":
            print(show(Scope[args.scope.upper()], path))
        elif args.action == "add":
            print(add_tenant_key(path, args.name))
        elif args.action == "list":
            for name, keys in list_tenants(path).items():
                print(f"{name}\t{len(keys)} key{'s' if len(keys) != 1 else ''}\t{' '.join(keys)}")
        else:
            gone = revoke_tenant(path, args.name, args.key)
            print(f"revoked {gone} key{'s' if gone != 1 else ''} of tenant {args.name}", file=sys.stderr)
        return 0
    except InvalidArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
