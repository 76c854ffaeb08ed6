"""bench/arguments.py: a bench's --smoke sizes are defaults; an option given on the command line wins. Every
bench takes --smoke through it (a check of their sources)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

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


# -- every bench's --smoke goes through parse_with_smoke ---------------------------------------------------

BENCH = Path(__file__).resolve().parents[2] / "bench"
#: Modules under bench/ that are not benches: the shared command line and the jobs benches run.
NOT_BENCHES = {"arguments.py", "quickstart_job.py", "simulated_job.py"}


def _smoke_test(node: ast.expr) -> bool:
    """`<name>.smoke` (or `.cpu_smoke`) somewhere in a condition: `args.smoke`, `not opts.smoke`, `a and args.smoke`."""
    return any(isinstance(n, ast.Attribute) and "smoke" in n.attr for n in ast.walk(node))


def _namespace_attributes(node: ast.expr) -> list[str]:
    """The `<name>.<option>` among assignment targets (a tuple's too)."""
    targets = node.elts if isinstance(node, (ast.Tuple, ast.List)) else [node]
    return [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)]


def smoke_overrides(source: str) -> list[str]:
    """What in a bench's source defines --smoke other than through parse_with_smoke, or overrides an option
    under it: `add_argument("--smoke", ...)`, `X if args.smoke else args.steps`, and `args.steps = ...` inside
    `if args.smoke:`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            if any(isinstance(a, ast.Constant) and a.value == "--smoke" for a in node.args):
                found.append(f"line {node.lineno}: add_argument(\"--smoke\"): use parse_with_smoke")
        elif isinstance(node, ast.IfExp) and _smoke_test(node.test):
            if isinstance(node.orelse, ast.Attribute) and isinstance(node.orelse.value, ast.Name):
                found.append(f"line {node.lineno}: {ast.unparse(node)}: a smoke size that replaces an option")
        elif isinstance(node, ast.If) and _smoke_test(node.test):
            for statement in node.body:
                for sub in ast.walk(statement):
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else []
                    for name in (a for t in targets for a in _namespace_attributes(t)):
                        found.append(f"line {sub.lineno}: {name} set under --smoke: a smoke size that replaces an option")
    return found


def test_the_check_finds_each_way_a_smoke_ignores_an_option() -> None:
    assert smoke_overrides('p.add_argument("--smoke", action="store_true")')
    assert smoke_overrides('p.add_argument("--smoke", "--cpu-smoke", dest="cpu_smoke")')
    assert smoke_overrides("reps = 2 if args.smoke else args.reps")
    assert smoke_overrides("if args.smoke:\n    args.size_mib, args.reps = 32, 1")
    assert smoke_overrides("if opts.smoke:\n    parts, opts.steps = {'trainer'}, 1")
    assert not smoke_overrides("base = TINY if args.smoke else QUICKSTART\nif args.smoke:\n    model = tiny()")
    assert not smoke_overrides('args = parse_with_smoke(parser, "small", steps=2)')


BENCHES = sorted(p for p in BENCH.glob("*.py") if p.name not in NOT_BENCHES)


@pytest.mark.parametrize("path", BENCHES, ids=[p.stem for p in BENCHES])
def test_every_bench_takes_smoke_through_parse_with_smoke(path: Path) -> None:
    """A bench's --smoke sizes are its options' defaults (bench/arguments.py), so an option given beside
    --smoke is honoured: none defines --smoke itself or replaces an option's value under it. (bench/gpu.py's
    older spelling --cpu-smoke is an add_argument with dest "smoke" beside parse_with_smoke's --smoke: the
    same flag, its sizes defaults as well.)"""
    source = path.read_text()
    assert not smoke_overrides(source), f"bench/{path.name}: {smoke_overrides(source)}"
    if "--smoke" in source:
        assert "parse_with_smoke(" in source, f"bench/{path.name} takes --smoke but not through parse_with_smoke"
