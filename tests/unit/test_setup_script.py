"""scripts/setup.sh: a second run is a no-op unless something it installs from changed, so every
requirements file it installs is in its stamp's hash; each pins exact versions and brings no torch
(the CPU build is installed first; most are installed without dependencies, and the OpenEnv server's
goes to a virtual environment of its own)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "scripts" / "setup.sh").read_text()


def installed() -> set[str]:
    """The files pip installs from: `-r FILE` in .venv, and `side_venv DIR FILE` for the virtual
    environments of their own (installed in the background beside .venv)."""
    return set(re.findall(r"(?: -r |^\s*side_venv \S+ )(requirements/[\w.-]+)", SCRIPT, re.MULTILINE))


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
    assert {"requirements/model-files.txt", "requirements/tinker-cookbook.txt", "requirements/openenv.txt",
            "requirements/verifiers.txt"} <= installed()
    assert installed() == hashed()


def test_the_files_pin_exact_versions_and_bring_no_torch() -> None:
    for path in installed():
        assert "torch" not in pinned(path), path


def test_the_cookbook_is_the_release_the_docs_name_without_its_unpublished_renderers() -> None:
    cookbook = pinned("requirements/tinker-cookbook.txt")
    assert cookbook["tinker-cookbook"] == "0.6.1"
    assert "tml-renderers" not in cookbook and "tinker" not in cookbook  # tinker: pyproject.toml pins it


#: A stand-in for python in a copy of the script's tree: `-m venv DIR` makes DIR/bin/python (itself),
#: `-m pip install ... -r FILE` succeeds, or fails when FILE is $FAIL_ON, after a second when it is $SLOW_ON
#: (a side environment still installing when .venv is done), and `-c` prints a version line.
FAKE_PYTHON = """#!/bin/sh
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0; fi
case "$*" in
  *"-r $FAIL_ON"*) echo "no such distribution for $FAIL_ON" >&2; exit 3;;
  *"-r $SLOW_ON"*) sleep 1; touch "$PWD/slow-done"; exit 0;;
  -c*) echo "torch (fake)"; exit 0;;
esac
exit 0
"""


def _run_setup(tmp_path: Path, fail_on: str = "-", slow_on: str = "-") -> subprocess.CompletedProcess:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tree / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    shutil.copytree(ROOT / "requirements", tree / "requirements")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": str(fake), "FAIL_ON": fail_on,
           "SLOW_ON": slow_on, "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=60)


def test_setup_waits_for_the_environments_installed_beside_venv(tmp_path: Path) -> None:
    done = _run_setup(tmp_path, slow_on="requirements/verifiers.txt")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "tree" / "slow-done").exists()  # the stamp came after the slow install, not before
    assert (tmp_path / "tree" / ".venv" / ".flywheel-setup").exists()
    assert {p.name for p in tmp_path.iterdir()} == {"tree", "python"}  # no install log left behind


def test_a_failed_side_environment_fails_setup_with_its_log_and_no_stamp(tmp_path: Path) -> None:
    done = _run_setup(tmp_path, fail_on="requirements/openenv.txt")
    assert done.returncode == 1
    assert "no such distribution for requirements/openenv.txt" in done.stderr
    assert "a side virtual environment failed" in done.stderr
    assert not (tmp_path / "tree" / ".venv" / ".flywheel-setup").exists()
    assert {p.name for p in tmp_path.iterdir()} == {"tree", "python"}
