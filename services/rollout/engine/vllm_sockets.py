"""Where vLLM's engine binds its ZMQ sockets, and their removal.

vLLM's front end and engine core talk over ZMQ `ipc://` sockets: files named
by a random uuid in VLLM_RPC_BASE_PATH, the system's temp directory unless it
is set. vLLM does not remove them when it shuts down: every start of the
rollout service left seven socket files in /tmp (measured: one
`make quickstart` on the tiny model), and a few hundred after a test run.

So each process that starts a vLLM engine gives it a directory of its own,
`<tmp>/flywheel-vllm-<pid>-<random>`, made once and removed when the process
exits. A process killed with SIGKILL cannot remove its own: the next process
that makes one removes every such directory whose process is gone. A
VLLM_RPC_BASE_PATH the user set is theirs, and left as it is.

vLLM's torch.distributed FileStore (`vllm_dist_<uuid>` in the engine core's
temp dir) is removed by torch when the engine stops cleanly; only a killed
engine leaves it. It stays in the temp dir on purpose: pointing the engine
core's TMPDIR at this directory (tried) moves torch inductor's precompiled
headers there too, a new path each start, so the kernels vLLM compiles missed
their cache: validation passes took 19.0-19.3 s against 16.7-17.7 s
(`bench/learning.py --parts validation`, the 2-core AMD EPYC, at 3814f85).

One directory per process, not per engine: vLLM may cache its environment
variables for the process's lifetime (vllm.envs.enable_envs_cache, called
where an engine core runs in this process), so a path it has read must stay
valid until the process ends.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

VARIABLE = "VLLM_RPC_BASE_PATH"
PREFIX = "flywheel-vllm-"
_SUN_PATH = 108

#: This process's directory, once made.
_made: Path | None = None


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
    """Remove the socket directories under `parent` whose process is gone; returns those removed."""
    removed = []
    for directory in parent.glob(f"{PREFIX}*"):
        pid = directory.name.removeprefix(PREFIX).split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            removed.append(directory)
    return removed


def use_private_socket_dir() -> Path | None:
    """Point VLLM_RPC_BASE_PATH at this process's own directory (made on the first call); None where
    the user set the variable themselves, or where the temp dir's path leaves no room for a socket's."""
    global _made
    if _made is not None:
        return _made
    if VARIABLE in os.environ:
        return None
    parent = Path(tempfile.gettempdir())
    remove_orphans(parent)
    if not room_for_sockets(parent, os.getpid()):  # vLLM keeps its own default, as it would without us
        return None
    _made = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
    os.environ[VARIABLE] = str(_made)
    atexit.register(_remove, _made, os.getpid())
    return _made


def _remove(directory: Path, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that inherited the exit hook
        shutil.rmtree(directory, ignore_errors=True)
