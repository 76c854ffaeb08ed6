"""Checks the layout tests share: what may stand at the top of a service package, and what a
module imports."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path


def absolute_imports(tree: ast.AST) -> list[tuple[int, str, tuple[str, ...]]]:
    """Every absolute import in `tree`, lazy ones inside functions too: (line, module, the names
    imported from it), the names empty for `import module`."""
    found: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, tuple(alias.name for alias in node.names)))
    return found


def top_level_strays(package: Path, files: Collection[str], subpackages: Collection[str]) -> list[str]:
    """Entries at the top of `package` that are not on the allow-lists `files` and `subpackages`
    (a subpackage must be a package: it holds an `__init__.py`); caches and dot files aside."""
    bad = []
    for entry in sorted(package.iterdir()):
        if entry.name == "__pycache__" or entry.name.startswith("."):
            continue
        if entry.is_dir():
            if entry.name not in subpackages or not (entry / "__init__.py").is_file():
                bad.append(f"{entry.name}/")
        elif entry.name not in files:
            bad.append(entry.name)
    return bad
