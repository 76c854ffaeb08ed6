"""bench/quickstart_job.py's work directory: a bench leaves nothing in the temp dir when it ends, keeps
what it was told to keep (--work), and keeps its runs when it failed, naming where."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench.quickstart_job import work_dir


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_temporary_work_directory_is_removed_when_the_bench_ends(temp_dir: Path) -> None:
    with work_dir(None, "flywheel-test-") as work:
        (work / "run").mkdir()
        assert work.parent == temp_dir and work.name.startswith("flywheel-test-")
    assert list(temp_dir.iterdir()) == []


def test_a_given_work_directory_is_made_and_kept(temp_dir: Path) -> None:
    given = temp_dir / "mine" / "runs"
    with work_dir(given, "flywheel-test-") as work:
        (work / "run").mkdir()
    assert work == given and (given / "run").is_dir()


def test_a_failed_bench_keeps_its_runs_and_says_where(temp_dir: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        with work_dir(None, "flywheel-test-") as work:
            (work / "rollout.log").write_text("why it failed")
            raise SystemExit("distill failed (1)")
    assert (work / "rollout.log").read_text() == "why it failed"
    assert f"its runs are kept in {work}" in capsys.readouterr().err
