"""The vLLM engine's socket directory (services/rollout/engine/vllm_sockets.py): vLLM leaves its ZMQ
socket files behind, so they go in a directory of the process's own that does not outlive it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.rollout.engine import vllm_sockets
from services.rollout.engine.vllm_sockets import PREFIX, VARIABLE, remove_orphans, use_private_socket_dir


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A temp dir with a path as short as /tmp's: pytest's own tmp_path leaves no room for a socket path."""
    made = Path(tempfile.mkdtemp(prefix="vs-", dir="/tmp"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def temp_dir(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(short_dir))
    monkeypatch.setattr(vllm_sockets, "_made", None)
    monkeypatch.delenv(VARIABLE, raising=False)
    return short_dir


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_process_gets_one_directory_of_its_own_and_vllm_is_pointed_at_it(temp_dir: Path) -> None:
    made = use_private_socket_dir()
    assert made is not None and made.parent == temp_dir and made.is_dir()
    assert made.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert os.environ[VARIABLE] == str(made)
    assert use_private_socket_dir() == made  # a second engine in the process: the same directory
    assert len(list(temp_dir.iterdir())) == 1


def test_a_variable_the_user_set_is_left_as_it_is(temp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VARIABLE, "/run/mine")
    assert use_private_socket_dir() is None
    assert os.environ[VARIABLE] == "/run/mine" and not list(temp_dir.iterdir())


def test_the_directory_of_a_killed_process_is_removed_by_the_next_one_and_a_live_ones_is_kept(temp_dir: Path) -> None:
    gone = temp_dir / f"{PREFIX}{dead_pid()}-abc"
    (gone / "inner").mkdir(parents=True)
    (gone / "inner" / "socket").write_text("")
    alive = temp_dir / f"{PREFIX}1-def"  # pid 1 runs as long as the machine does
    alive.mkdir()
    unrelated = temp_dir / "flywheel-vllm-notapid"
    unrelated.mkdir()
    made = use_private_socket_dir()
    assert not gone.exists() and alive.is_dir() and unrelated.is_dir() and made.is_dir()
    assert remove_orphans(temp_dir) == []  # nothing more to remove, and never this process's own


def test_the_directory_is_removed_when_its_process_exits(short_dir: Path) -> None:
    program = (
        "import tempfile; tempfile.tempdir = " + repr(str(short_dir)) + "\n"
        "from services.rollout.engine.vllm_sockets import use_private_socket_dir\n"
        "made = use_private_socket_dir(); (made / 'a-socket').write_text(''); print(made)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(short_dir / PREFIX)) and not list(short_dir.iterdir())


def test_a_temp_dir_too_long_for_a_socket_path_leaves_vllm_its_default(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("d" * (100 - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr(vllm_sockets, "_made", None)
    monkeypatch.delenv(VARIABLE, raising=False)
    assert use_private_socket_dir() is None
    assert VARIABLE not in os.environ and not list(deep.iterdir())
