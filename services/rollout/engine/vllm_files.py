"""Where vLLM's engine leaves its files, and their removal.

vLLM leaves two kinds of files behind when it shuts down:
- its front end and engine core talk over ZMQ `ipc://` sockets: files named
  by a random uuid in VLLM_RPC_BASE_PATH, the system's temp directory unless
  it is set. Every start of the rollout service left seven of them in /tmp
  (measured: one `make quickstart` on the tiny model), a few hundred after a
  test run;
- its executor sets up torch.distributed (world size 1 on one CPU) through a
  FileStore, a file `vllm_dist_<uuid>` in the engine core's temp directory:
  one per engine start, never removed (297 after a few days of test runs).

So each process that starts a vLLM engine gives it a directory of its own,
`<tmp>/flywheel-vllm-<pid>-<random>`, made once and removed when the process
exits. While an engine starts (`engine_files`), VLLM_RPC_BASE_PATH points
there, and so does TMPDIR for the processes it starts (the engine core and its
workers); then both are as they were, so that nothing else this process starts
later inherits them (a test worker that ran an engine starts services after).
This process's own temp dir was read before, and stays. torch's
compiled-kernel cache is kept where it was (TORCHINDUCTOR_CACHE_DIR, unless
the user set it), or every start would compile again. A process killed with
SIGKILL cannot remove its own directory: the next process that makes one
removes every such directory whose process is gone. A VLLM_RPC_BASE_PATH the
user set is theirs, and left as it is; so is a temp dir whose path leaves no
room for a socket's (the sockets then stay at vLLM's default).

One directory per process, not per engine: vLLM may cache its environment
variables for the process's lifetime (vllm.envs.enable_envs_cache, called
where an engine core runs in this process), so a path it has read must stay
valid until the process ends.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

SOCKETS = "VLLM_RPC_BASE_PATH"
TEMP = "TMPDIR"
KERNEL_CACHE = "TORCHINDUCTOR_CACHE_DIR"
PREFIX = "flywheel-vllm-"
_SUN_PATH = 108

#: This process's directory, once made.
_made: Path | None = None
#: Engines of this process starting now, and the variables as they were before the first of them.
_starting = 0
_before: dict[str, str | None] = {}
_lock = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


def room_for_sockets(parent: Path, pid: int) -> bool:
    """Whether vLLM's socket paths fit in sun_path (108 bytes with its NUL) inside a directory of process
    `pid` under `parent`: the temp dir, the directory's name (the prefix, the pid, mkdtemp's 8 characters)
    and vLLM's 36-character uuid. A long temp dir can leave no room."""
    return len(f"{parent}/{PREFIX}{pid}-12345678/") + 36 <= _SUN_PATH - 1


def remove_orphans(parent: Path) -> list[Path]:
    """Remove the engine directories under `parent` whose process is gone; returns those removed."""
    removed = []
    for directory in parent.glob(f"{PREFIX}*"):
        pid = directory.name.removeprefix(PREFIX).split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            removed.append(directory)
    return removed


def private_dir() -> Path:
    """This process's engine directory, made on the first call."""
    global _made
    if _made is None:
        parent = Path(tempfile.gettempdir())  # read (and kept) by this process before TMPDIR changes
        remove_orphans(parent)
        _made = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
        atexit.register(_remove, _made, os.getpid())
    return _made


def engine_variables(directory: Path, env: Mapping[str, str]) -> dict[str, str]:
    """What an engine starting with `directory` needs set in `env`: its sockets there (unless the user
    chose their place, or the path leaves no room), its processes' temp dir there, and torch's kernel
    cache where it was."""
    wanted = {TEMP: str(directory)}
    if SOCKETS not in env and room_for_sockets(directory.parent, os.getpid()):
        wanted[SOCKETS] = str(directory)
    if KERNEL_CACHE not in env:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # vLLM has imported it

        wanted[KERNEL_CACHE] = default_cache_dir()
    return wanted


@contextlib.contextmanager
def engine_files() -> Iterator[Path]:
    """Around an engine's start: its files go in this process's directory. Engines may start together
    in one process; the variables are restored when the last of them has started."""
    global _starting
    with _lock:
        directory = private_dir()
        if _starting == 0:
            wanted = engine_variables(directory, os.environ)
            _before.clear()
            _before.update({name: os.environ.get(name) for name in wanted})
            os.environ.update(wanted)
        _starting += 1
    try:
        yield directory
    finally:
        with _lock:
            _starting -= 1
            if _starting == 0:
                for name, value in _before.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value


def _remove(directory: Path, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that inherited the exit hook
        shutil.rmtree(directory, ignore_errors=True)
