"""Paths from requests stay inside the service's directories (flywheel.runtime.paths)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from flywheel.runtime.paths import confine


def test_paths_inside_a_root_are_resolved(tmp_path: Path) -> None:
    root, other = tmp_path / "checkpoints", tmp_path / "published"
    root.mkdir()
    assert confine("global_step_3", [root, other], "path") == root.resolve() / "global_step_3"
    assert confine(str(other / "version_2"), [root, other], "path") == other.resolve() / "version_2"
    assert confine(str(root), [root], "path") == root.resolve()
    assert confine("a/../b", [root], "path") == root.resolve() / "b"


@pytest.mark.parametrize("requested", ["../escape", "/etc", "a/../../escape", "/"])
def test_traversal_and_absolute_paths_outside_are_denied(tmp_path: Path, requested: str) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    with pytest.raises(PermissionDenied, match=r"directory: .* is outside the directories this service may use"):
        confine(requested, [root], "directory")


def test_a_sibling_that_shares_the_roots_prefix_is_outside(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    with pytest.raises(PermissionDenied):
        confine(str(tmp_path / "ck-evil"), [tmp_path / "ck"], "path")


def test_symbolic_links_that_leave_the_root_are_denied(tmp_path: Path) -> None:
    root, outside = tmp_path / "checkpoints", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "out").symlink_to(outside)
    (root / "in").symlink_to(root / "global_step_1")
    with pytest.raises(PermissionDenied):
        confine("out/global_step_1", [root], "path")
    assert confine("in", [root], "path") == root.resolve() / "global_step_1"


@pytest.mark.parametrize(
    ("requested", "problem"),
    [("ck\0pt", "NUL byte"), ("x" * 300, "name of 300 bytes"), ("a/" * 2100, "more than the 4096")],
)
def test_text_no_file_system_holds_is_invalid(tmp_path: Path, requested: str, problem: str) -> None:
    with pytest.raises(InvalidArgument, match=problem):
        confine(requested, [tmp_path], "path")


def test_a_service_with_no_root_takes_no_paths(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="accepts no paths"):
        confine(str(tmp_path), [], "checkpoint.path")
