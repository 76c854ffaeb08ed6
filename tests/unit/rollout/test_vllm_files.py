"""The vLLM engine's directory (services/rollout/engine/vllm_files.py): vLLM leaves its ZMQ socket files
and its FileStore behind, so they go in a directory of the process's own that does not outlive it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.rollout.engine import vllm_files
from services.rollout.engine.vllm_files import KERNEL_CACHE, PREFIX, SOCKETS, TEMP, engine_files, remove_orphans


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A temp dir with a path as short as /tmp's: pytest's own tmp_path leaves no room for a socket path."""
    made = Path(tempfile.mkdtemp(prefix="vs-", dir="/tmp"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def temp_dir(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(short_dir))
    monkeypatch.setattr(vllm_files, "_made", None)
    for name in (SOCKETS, TEMP, KERNEL_CACHE):
        monkeypatch.delenv(name, raising=False)
    return short_dir


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_engine_starts_with_its_files_in_the_process_own_directory_and_nothing_else_inherits_that(
    temp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TEMP, "/var/tmp")  # the user's: back as it was after the start
    with engine_files() as made:
        assert made.parent == temp_dir and made.is_dir() and made.name.startswith(f"{PREFIX}{os.getpid()}-")
        assert os.environ[SOCKETS] == str(made) and os.environ[TEMP] == str(made)
        assert os.environ[KERNEL_CACHE].startswith(str(temp_dir))  # the kernel cache where it was: not in it
        # what the engine core sees, started now (vLLM spawns it): its temp files land in the directory
        seen = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
        assert seen == str(made)
        with engine_files() as again:  # a second engine starting in the process: the same directory
            assert again == made
        assert os.environ[TEMP] == str(made)  # the first is still starting
    assert SOCKETS not in os.environ and KERNEL_CACHE not in os.environ and os.environ[TEMP] == "/var/tmp"
    assert tempfile.gettempdir() == str(temp_dir)  # this process's own is unchanged
    assert list(temp_dir.iterdir()) == [made]


def test_a_socket_path_the_user_set_is_left_as_it_is(temp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SOCKETS, "/run/mine")
    with engine_files() as made:
        assert os.environ[SOCKETS] == "/run/mine" and os.environ[TEMP] == str(made)
    assert os.environ[SOCKETS] == "/run/mine"


def test_the_directory_of_a_killed_process_is_removed_by_the_next_one_and_a_live_ones_is_kept(temp_dir: Path) -> None:
    gone = temp_dir / f"{PREFIX}{dead_pid()}-abc"
    (gone / "inner").mkdir(parents=True)
    (gone / "inner" / "socket").write_text("")
    alive = temp_dir / f"{PREFIX}1-def"  # pid 1 runs as long as the machine does
    alive.mkdir()
    unrelated = temp_dir / "flywheel-vllm-notapid"
    unrelated.mkdir()
    with engine_files() as made:
        assert not gone.exists() and alive.is_dir() and unrelated.is_dir() and made.is_dir()
    assert remove_orphans(temp_dir) == []  # nothing more to remove, and never this process's own


def test_the_directory_is_removed_when_its_process_exits(short_dir: Path) -> None:
    program = (
        "import tempfile; tempfile.tempdir = " + repr(str(short_dir)) + "\n"
        "from services.rollout.engine.vllm_files import private_dir\n"
        "made = private_dir(); (made / 'a-socket').write_text(''); print(made)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != SOCKETS}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(short_dir / PREFIX)) and not list(short_dir.iterdir())


def test_a_temp_dir_too_long_for_a_socket_path_leaves_vllm_its_socket_default(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("d" * (100 - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr(vllm_files, "_made", None)
    monkeypatch.delenv(SOCKETS, raising=False)
    with engine_files() as made:
        assert SOCKETS not in os.environ and os.environ[TEMP] == str(made)  # the FileStore has no such limit
