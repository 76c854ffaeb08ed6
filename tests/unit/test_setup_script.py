"""scripts/setup.sh: a second run is a no-op unless something it installs from changed, so every
requirements file it installs is in its stamp's hash; each pins exact versions and brings no torch
(the CPU build is installed first; most are installed without dependencies, and the OpenEnv server's
goes to a virtual environment of its own)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "scripts" / "setup.sh").read_text()


def installed() -> set[str]:
    return set(re.findall(r" -r (requirements/[\w.-]+)", SCRIPT))


def hashed() -> set[str]:
    (want,) = [line for line in SCRIPT.splitlines() if line.startswith("want=")]
    return set(re.findall(r"requirements/[\w.-]+", want))


def pinned(path: str) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in (ROOT / path).read_text().splitlines()]
    out = {}
    for line in filter(None, lines):
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
        assert match, f"{path}: {line!r} is not pinned to one version"
        out[match.group(1).lower().replace("_", "-")] = match.group(2)
    return out


def test_every_requirements_file_it_installs_is_in_its_stamp() -> None:
    assert {"requirements/model-files.txt", "requirements/tinker-cookbook.txt", "requirements/openenv.txt"} <= installed()
    assert installed() == hashed()


def test_the_files_pin_exact_versions_and_bring_no_torch() -> None:
    for path in installed():
        assert "torch" not in pinned(path), path


def test_the_cookbook_is_the_release_the_docs_name_without_its_unpublished_renderers() -> None:
    cookbook = pinned("requirements/tinker-cookbook.txt")
    assert cookbook["tinker-cookbook"] == "0.6.1"
    assert "tml-renderers" not in cookbook and "tinker" not in cookbook  # tinker: pyproject.toml pins it
