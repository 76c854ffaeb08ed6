"""The trainer's modules form a layered graph: no import cycle, no borrowed private names.

Checked on the source (ast), so an import inside a function counts as much
as one at the top of a module: a cycle closed by a lazy import is still a
cycle. Every spelling that names a module of the package counts (`import
services.trainer.x`, `from services.trainer.x import y`, `from
services.trainer import x`, relative forms), and so does reaching a private
(`_name`) of another module, by import or as `module._name`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "services" / "trainer"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_modules(package: Path, name: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `package` (itself named `name`)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([name, *parts])] = path
    return modules


def _owner(dotted: str, modules: dict[str, Path]) -> str | None:
    """The module of the package that `dotted` lies in (itself or its nearest enclosing one)."""
    while dotted:
        if dotted in modules:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


def _absolute(node: ast.ImportFrom, importer: str, path: Path) -> str:
    if node.level == 0:
        return node.module or ""
    # Relative to the importer's package (a package's __init__ is its own package).
    base = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def scan(package: Path, name: str) -> tuple[dict[str, set[str]], list[str]]:
    """(import graph between the package's modules, cross-module uses of private names)."""
    modules = package_modules(package, name)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []
    for importer, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(package.parent)
        # Local names bound to another module of the package (`from pkg import m`, `import pkg.m as m`).
        bound: dict[str, str] = {}

        def depend(target: str | None, line: int, names: list[str]) -> None:
            if target is None or target == importer:
                return
            graph[importer].add(target)
            private.extend(f"{where}:{line} imports {target}.{n}" for n in names if _private(n))

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _owner(alias.name, modules)
                    depend(target, node.lineno, [])
                    if target is not None and alias.asname:
                        bound[alias.asname] = target
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, importer, path)
                target = _owner(source, modules)
                if target is None:
                    continue
                plain = []
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:  # `from pkg import m`: the module m itself
                        depend(sub, node.lineno, [alias.name] if _private(alias.name) else [])
                        bound[alias.asname or alias.name] = sub
                    else:
                        plain.append(alias.name)
                if plain:
                    depend(target, node.lineno, plain)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and bound[node.value.id] != importer and _private(node.attr)):
                private.append(f"{where}:{node.lineno} uses {bound[node.value.id]}.{node.attr}")
    return graph, sorted(private)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles (a -> ... -> a) met on a depth-first walk, one per new set of modules: empty
    exactly when the graph has none."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, trail: list[str], on_trail: set[str]) -> None:
        trail.append(node)
        on_trail.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_trail:
                cycle = trail[trail.index(nxt):] + [nxt]
                if not any(set(cycle) <= set(c) for c in found):
                    found.append(cycle)
            elif nxt not in done:
                visit(nxt, trail, on_trail)
        trail.pop()
        on_trail.discard(node)
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [], set())
    return found


def test_the_trainer_imports_form_no_cycle() -> None:
    graph, _ = scan(TRAINER, "services.trainer")
    assert cycles(graph) == []


def test_no_trainer_module_reaches_into_anothers_private_names() -> None:
    _, private = scan(TRAINER, "services.trainer")
    assert private == []


def test_the_graph_sees_the_trainer() -> None:
    graph, _ = scan(TRAINER, "services.trainer")
    # `from services.trainer import checkpoints` and a plain `from ... import` both count.
    assert {"services.trainer.checkpoints", "services.trainer.policy"} <= graph["services.trainer.training"]
    assert "services.trainer.export" in graph["services.trainer.link"]


def test_the_check_sees_a_cycle_and_a_private_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.b import g\n")  # lazy: still an edge
    (package / "b.py").write_text("from pkg import c\n\ndef g():\n    return c._hidden\n")
    (package / "c.py").write_text("from . import a\n\n_hidden = 1\n")
    (package / "d.py").write_text("import pkg.c\nfrom pkg.c import _hidden\n")
    graph, private = scan(package, "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert private == ["pkg/b.py:4 uses pkg.c._hidden", "pkg/d.py:2 imports pkg.c._hidden"]

    (package / "c.py").write_text("_hidden = 1\n")
    graph, _ = scan(package, "pkg")
    assert cycles(graph) == []
