"""The tree's import boundaries: a service package is that service alone.

Services share code only through `flywheel/`; `flywheel/` never reaches into
a service. Checked on the source (ast), so a lazy import inside a function
counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.layout_checks import absolute_imports

ROOT = Path(__file__).resolve().parents[2]
#: Front doors, not shared code: the `flywheel` command dispatches `flywheel run` to the controller's launcher.
ENTRY_POINTS = {"flywheel/cli.py"}
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists())


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for line, module, names in absolute_imports(ast.parse(path.read_text(), filename=str(path))):
        found.append((line, module))
        # `from services import rollout` imports a service package too.
        if module == "services":
            found += [(line, f"services.{name}") for name in names]
    return found


def violations(package: Path, allowed: str | None) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        if str(path.relative_to(ROOT)) in ENTRY_POINTS:
            continue
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service(service: str) -> None:
    assert violations(ROOT / "services" / service, allowed=service) == []


def test_shared_code_imports_no_service() -> None:
    assert violations(ROOT / "flywheel", allowed=None) == []


def test_the_check_sees_a_crossing(tmp_path: Path) -> None:
    package = tmp_path / "svc"
    package.mkdir()
    (package / "m.py").write_text("def f():\n    from services.trainer.config import X\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert violations(package, allowed="rollout") == ["svc/m.py:2 imports services.trainer.config"]
        assert violations(package, allowed="trainer") == []
    finally:
        ROOT = saved


def test_every_service_is_checked() -> None:
    assert {"controller", "rollout", "synchronizer", "trainer"} <= set(SERVICES)
