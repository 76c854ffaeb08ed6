"""Makes the tokens file every shipped deployment runs on, and reads one token back out.

    python -m flywheel.runtime.tokens init FILE          # a fresh token per scope, unless FILE exists
    python -m flywheel.runtime.tokens init --from - FILE < tokens.yaml   # another deployment's tokens
    python -m flywheel.runtime.tokens show SCOPE [FILE]  # FILE's (default $FLYWHEEL_TOKENS_FILE) SCOPE token

`init` writes FILE (mode 0600) with one random token for each scope of
`flywheel.runtime.auth.Scope` (viewer, agent, service, operator), in the format
`read_tokens_file` reads. It leaves an existing FILE as it is, so that the
compose init service can run at every `docker compose up` and the tokens stay
those clients already hold; `--from` copies another deployment's tokens file
instead (read from stdin with `-`, so that a container needs no host file it
could not read), for a far site that must hold the central site's tokens. `show` prints one token, for handing each client the
least it needs: agents the `agent` token, whoever looks at the status page the
`viewer` one; never the `operator` token to an agent.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from flywheel.errors import InvalidArgument
from flywheel.runtime.auth import TOKENS_FILE_ENV, Scope, parse_tokens, read_tokens_file

#: 32 random bytes, hex: 256 bits a guesser would have to find.
TOKEN_BYTES = 32
#: Every token starts so: the Tinker SDK sends only API keys that do, and the `service`
#: token is what a Tinker client holds (services/tinker).
TOKEN_PREFIX = "tml-"


def new_tokens_yaml() -> str:
    """A tokens file's text: one fresh token per scope, lowest scope first."""
    header = "# Flywheel bearer tokens by scope (python -m flywheel.runtime.tokens); keep this file secret.\n"
    return header + "".join(f"{scope}: {TOKEN_PREFIX}{secrets.token_hex(TOKEN_BYTES)}\n" for scope in Scope)


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
    show_command.add_argument("scope", choices=[str(s) for s in Scope])
    show_command.add_argument("file", type=Path, nargs="?", help=f"default ${TOKENS_FILE_ENV}")
    args = parser.parse_args(argv)
    try:
        if args.command == "init":
            source = None if args.source is None else (
                sys.stdin.read() if args.source == "-" else Path(args.source).read_text())
            wrote = init(args.file, source)
            print(f"{'wrote' if wrote else 'kept the existing'} tokens file {args.file} "
                  f"(scopes {', '.join(str(s) for s in Scope)})", file=sys.stderr)
            return 0
        path = args.file or (Path(os.environ[TOKENS_FILE_ENV]) if os.environ.get(TOKENS_FILE_ENV) else None)
        if path is None:
            parser.error(f"show: give FILE or set {TOKENS_FILE_ENV}")
        print(show(Scope[args.scope.upper()], path))
        return 0
    except InvalidArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
