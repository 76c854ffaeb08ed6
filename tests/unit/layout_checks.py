"""Checks the layout tests share: what may stand at the top of a service package."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path


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
