"""The command line the benches share: the module docstring as --help, and --smoke.

Every bench takes --smoke, the size CI runs it at (tests/integration/test_bench_smokes.py and the
test_bench_<name>.py files): the bench's own code on a job small enough to show in a few minutes that it
still runs and ends with its JSON line. A bench names its smoke sizes in the one call that parses its
command line, beside its other options.
"""

from __future__ import annotations

import argparse
from typing import Any


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help is the bench's module docstring laid out as written: its run manual."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_with_smoke(parser: argparse.ArgumentParser, smoke_help: str, **smoke_sizes: Any) -> argparse.Namespace:
    """Adds --smoke (`smoke_help` says what it runs) and parses the command line; under --smoke each of
    `smoke_sizes` (keyed by the option's dest: `in_flight` for --in-flight) is its option's default, and an
    option given on the command line still wins (`--smoke --steps 5`)."""
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    args = parser.parse_args()
    unknown = sorted(set(smoke_sizes) - set(vars(args)))
    if unknown:
        raise ValueError(f"smoke sizes for options the bench does not have: {unknown}")
    if args.smoke:
        parser.set_defaults(**smoke_sizes)
        args = parser.parse_args()
    return args
