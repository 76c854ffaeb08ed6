"""bench/arguments.py: a bench's --smoke sizes are defaults; an option given on the command line wins."""

from __future__ import annotations

import sys

import pytest

from bench.arguments import bench_parser, parse_with_smoke


def parse(monkeypatch: pytest.MonkeyPatch, *argv: str):
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    parser = bench_parser("a bench")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=384)
    return parse_with_smoke(parser, "small", steps=2, max_tokens=128)


def test_the_smoke_sizes_replace_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(monkeypatch, "--smoke")
    assert (args.smoke, args.steps, args.max_tokens) == (True, 2, 128)
    assert (parse(monkeypatch).steps, parse(monkeypatch).max_tokens) == (30, 384)


def test_an_option_given_beside_smoke_is_honoured_not_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(monkeypatch, "--smoke", "--max-tokens", "256")
    assert (args.steps, args.max_tokens) == (2, 256)


def test_a_smoke_size_for_an_option_the_bench_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.py", "--smoke"])
    with pytest.raises(ValueError, match="warmup"):
        parse_with_smoke(bench_parser("a bench"), "small", warmup=1)
