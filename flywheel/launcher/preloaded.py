"""A preloaded interpreter: services started as forks of one Python process that has already
imported torch and transformers, instead of as fresh `python -m services.<name>` processes.

Every trainer, rollout and synchronizer imports torch (1.5 s of a core), and the first two import
transformers' model code too (2.8 s more), before they do any work of their own. A machine that
starts services by the hundred, as the test suite does, pays that for each one. Here it is paid once:

    python -m flywheel.launcher.preloaded SOCKET     # imports, then forks a child per request

and `start_service` (processes.py) asks it for a child when `PRELOADED_ENV` names its socket in the
launcher's environment. Off unless that variable is set: `flywheel up` and the local run start fresh
interpreters, as before. The test suite sets it for each of its workers (tests/preloaded.py).

A child is the service as `python -m` would run it: its own arguments (and command line, as `ps`
shows it), environment, working directory, standard streams (passed over the socket), process group
and module run as `__main__`; its random generators reseeded. Two things differ: it is this process's
child, not the launcher's, and /proc shows this process's environment as its own. What the imports
read from the environment cannot change after them, so a request whose environment differs from this
process's in such a variable (`IMPORT_SETTINGS`) is refused, and the launcher starts a fresh
interpreter instead. gRPC is not imported here: its fork handlers are what made the launcher stop
running Python between fork and exec (processes.py).

Each child's request keeps its connection open as the child's lifeline. The child's exit code comes
back on it (`Popen`'s convention: -N for a signal); when the launcher's end closes (the launcher
died), the child gets SIGTERM, as `PR_SET_PDEATHSIG` gives a child of the launcher.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

#: The launcher's environment names the socket of a preloaded interpreter here; unset: none is used.
PRELOADED_ENV = "FLYWHEEL_PRELOADED_INTERPRETER"

#: What is imported once: what every service's start spends its first seconds on. Not gRPC (above).
PRELOAD = (
    "numpy", "torch", "safetensors.torch", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto", "pydantic", "yaml", "fastapi", "uvicorn", "prometheus_client",
)

#: Environment variables read while those modules import (threads, kernels, caches, library settings):
#: a child that asks for other values than this process imported with gets a fresh interpreter.
IMPORT_SETTINGS = ("OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "ATEN_", "ONEDNN_", "DNNL_", "TORCH", "PYTORCH_",
                   "CUDA", "NVIDIA_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "SAFETENSORS_", "TRITON",
                   "PYTHON", "LD_", "MALLOC_", "NUMEXPR_", "XDG_CACHE_HOME")
#: Read by the interpreter at start, which a child sets up again as a fresh one would (`_become`).
REDONE_IN_CHILD = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")
#: Set by vLLM in its own process when it is imported or configures an engine on the CPU (its
#: platforms/cpu.py), so a launcher that did (a test that runs an engine in-process) passes them on. A
#: child that runs vLLM sets them again, before vLLM starts the processes they are for (LD_PRELOAD's
#: allocator and OpenMP, for its engine core); what they steer otherwise (CUDA checks, triton,
#: torch.compile's threads, numexpr, OpenCV's bundled libraries) is nothing the preload loaded or used.
SET_BY_VLLM = ("PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
               "TRITON_CACHE_AUTOTUNING", "TILELANG_CLEANUP_TEMP_FILES", "LD_LIBRARY_PATH", "LD_PRELOAD",
               "NUMEXPR_MAX_THREADS")

#: How long children have to stop after this process is told to stop, before they are killed.
STOP_GRACE_SECONDS = 15.0

#: Signals this process handles itself, which a child must not receive before it sets its own.
_HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)

_MESSAGE = 1 << 20  # a request (arguments and environment) fits in one packet of this size


def differing_import_settings(env: Mapping[str, str], imported_with: Mapping[str, str],
                              set_by_imports: Mapping[str, str] | None = None) -> list[str]:
    """The variables of `IMPORT_SETTINGS` whose value in `env` is not the one the imports saw. One the
    imports set themselves (torch's inductor names its cache directory) may be absent, or the same."""
    set_by_imports = set_by_imports or {}
    names = {k for k in (*env, *imported_with)
             if k.startswith(IMPORT_SETTINGS) and k not in REDONE_IN_CHILD and k not in SET_BY_VLLM}
    return sorted(k for k in names if env.get(k) != imported_with.get(k)
                  and not (k in set_by_imports and env.get(k) in (None, set_by_imports[k])))


# ----- the launcher's side ---------------------------------------------------------------------------


class PreloadedChild:
    """A child of the preloaded interpreter, as much of `subprocess.Popen` as the launchers use: `pid`,
    `args`, `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`."""

    def __init__(self, connection: socket.socket, pid: int, args: list[str]) -> None:
        connection.setblocking(False)
        self._connection, self.pid, self.args = connection, pid, args
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._read(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a pid whose exit was reported may already be another process's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> int | None:
        """The exit code once reported, waiting up to `timeout` seconds (None: for ever). The lock is
        never held while waiting: a `poll` from another thread answers at once, as Popen's does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self.returncode is None:
                    self._take_report()
                if self.returncode is not None:
                    return self.returncode
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            readable = select.poll()  # not select(): a launcher may hold descriptors past its 1024
            try:
                readable.register(self._connection, select.POLLIN)
                readable.poll(None if remaining is None else max(1, int(remaining * 1000)))
            except (OSError, ValueError):  # closed by another thread, which took the report
                pass

    def _take_report(self) -> None:
        try:
            message = self._connection.recv(64)
        except BlockingIOError:
            return
        except OSError:
            message = b""
        self._connection.close()
        if message.startswith(b"exit "):
            self.returncode = int(message.split()[1])
        else:  # the preloaded interpreter died: its death signal ended the child, unreaped by it
            self._await_gone(timeout=30.0)
            self.returncode = -signal.SIGTERM

    def _await_gone(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def spawn(module: str, args: Sequence[str], env: Mapping[str, str], stdout: int, stderr: int,
          socket_path: str | None = None, timeout: float = 10.0) -> PreloadedChild | None:
    """Runs `python -m <module> <args>` as a fork of the preloaded interpreter at `socket_path`
    (default: `PRELOADED_ENV`), with `env`, this working directory, stdin from /dev/null and the
    given output descriptors, in a process group of its own. None where there is no such interpreter,
    it does not answer within `timeout`, or it refuses the request (`IMPORT_SETTINGS`): then start a
    fresh one."""
    socket_path = socket_path or os.environ.get(PRELOADED_ENV)
    if not socket_path:
        return None
    request = json.dumps({"module": module, "args": list(args), "env": dict(env), "cwd": os.getcwd()}).encode()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.settimeout(timeout)
    try:
        with open(os.devnull, "rb") as devnull:
            connection.connect(socket_path)
            socket.send_fds(connection, [request], [devnull.fileno(), stdout, stderr])
        reply = connection.recv(256).decode()
    except OSError:
        connection.close()
        return None
    if not reply.startswith("pid "):
        connection.close()
        return None
    return PreloadedChild(connection, int(reply.split()[1]), [sys.executable, "-m", module, *args])


# ----- the preloaded interpreter -------------------------------------------------------------------


def _serve(socket_path: str, imported_with: Mapping[str, str], set_by_imports: Mapping[str, str]) -> dict | None:
    """Answers requests until the listening socket is closed (returns None: exit) or a fork makes
    this process a child (returns its request)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector through the wakeup fd
    children: dict[int, socket.socket] = {}  # pid -> its lifeline
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    selector.register(wake_read, selectors.EVENT_READ, "wake")
    stopping, killing_at, forked = False, float("inf"), 0

    def stop(*_: object) -> None:
        nonlocal stopping, killing_at
        stopping, killing_at = True, time.monotonic() + STOP_GRACE_SECONDS

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"preloaded interpreter ready on {socket_path}", flush=True)
    while not stopping or children:
        if stopping and listener.fileno() >= 0:
            selector.unregister(listener)
            listener.close()
            os.unlink(socket_path)
            for pid in children:
                _signal(pid, signal.SIGTERM)
        if time.monotonic() > killing_at:
            for pid in children:
                _signal(pid, signal.SIGKILL)
        for key, _ in selector.select(timeout=1.0):
            if key.data == "wake":
                os.read(wake_read, 4096)
            elif key.data == "listener":
                try:
                    connection, _ = listener.accept()
                except OSError:
                    continue
                request = _accept(connection, imported_with, set_by_imports)
                if request is None:
                    continue
                # Held until the child has its own handlers (_become): a SIGTERM between the fork and
                # then would reach this process's handler in the child, and be lost.
                signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
                pid = os.fork()
                if pid != 0:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
                if pid == 0:
                    selector.close()
                    for lifeline in children.values():
                        lifeline.close()
                    listener.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    connection.close()
                    return request
                try:  # here too, so that its group exists once the launcher learns its pid (it may signal it)
                    os.setpgid(pid, pid)
                except OSError:
                    pass  # it already has, or already exited
                for fd in request["fds"]:
                    os.close(fd)
                forked += 1
                children[pid] = connection
                try:
                    connection.sendall(f"pid {pid}".encode())
                    selector.register(connection, selectors.EVENT_READ, pid)
                except OSError:  # the launcher is gone already: as when its lifeline closes (below)
                    _signal(pid, signal.SIGTERM)
            else:  # a lifeline's other end closed: the launcher that asked for this child is gone
                pid = key.data
                selector.unregister(key.fileobj)
                _signal(pid, signal.SIGTERM)
        _reap(children, selector)
    print(f"preloaded interpreter stopped after {forked} children", flush=True)
    return None


def _accept(connection: socket.socket, imported_with: Mapping[str, str],
            set_by_imports: Mapping[str, str]) -> dict | None:
    """The request on `connection`, with its descriptors; None where it was refused (said on it)."""
    connection.settimeout(10.0)
    fds: list[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(connection, _MESSAGE, 3)
        request = json.loads(message)
        request["fds"] = fds
        request["env"] = {**set_by_imports, **request["env"]}  # as a fresh interpreter's imports would set them
        differing = differing_import_settings(request["env"], imported_with, set_by_imports)
        if len(fds) != 3 or differing:
            for fd in fds:
                os.close(fd)
            fds = []
            reason = f"refused {request['module']}: set differently from the preload: {' '.join(differing)}"
            print(reason, flush=True)
            connection.sendall(reason.encode()[:250])
            connection.close()
            return None
    except (OSError, ValueError, KeyError):  # not a request: what came with it is not kept open
        for fd in fds:
            os.close(fd)
        connection.close()
        return None
    connection.setblocking(False)
    return request


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        lifeline = children.pop(pid, None)
        if lifeline is None:
            continue
        try:
            selector.unregister(lifeline)
        except (KeyError, ValueError):
            pass  # unregistered when its launcher went away
        try:
            lifeline.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
        except OSError:
            pass
        lifeline.close()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _become(request: dict, preloader: int) -> None:
    """In the forked child: everything `python -m <module>` would have set up, then run it."""
    import runpy

    import setproctitle

    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # what came meanwhile is delivered now, to these
    os.setpgid(0, 0)
    # What `ps` and /proc/<pid>/cmdline show: the command a fresh interpreter would have had. Before the
    # environment is replaced: the title takes the room of the original environment's strings.
    setproctitle.setproctitle(" ".join([sys.executable, "-m", request["module"], *request["args"]]))
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != preloader:
            os._exit(1)
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_standard_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.path[0] = os.getcwd()  # as `-m` sets it
    _reseed()
    sys.argv = [request["module"], *request["args"]]  # [0] becomes the module's file, as with `-m`
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _fresh_standard_streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr over descriptors 0-2, buffered as a new interpreter buffers them."""

    def writer(fd: int, errors: str, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                                line_buffering=line_buffering and not unbuffered, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = sys.__stdout__ = writer(1, "strict", os.isatty(1))
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", True)


def _reseed() -> None:
    """Fresh seeds, as a new interpreter draws (the `random` module reseeds itself after a fork)."""
    import numpy
    import torch

    numpy.random.seed()
    torch.seed()


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1:
        sys.exit("usage: python -m flywheel.launcher.preloaded SOCKET")
    from flywheel.launcher.processes import die_with_launcher
    from flywheel.runtime.triton_gate import keep_triton_out

    die_with_launcher()
    keep_triton_out()  # as every service's entry does, before torch
    import gc
    import importlib

    imported_with = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    set_by_imports = {k: v for k, v in os.environ.items() if imported_with.get(k) != v}
    gc.collect()
    gc.freeze()  # what the imports made stays out of the children's collections (and their pages shared)
    preloader = os.getpid()
    request = _serve(argv[0], imported_with, set_by_imports)
    if request is not None:
        _become(request, preloader)


if __name__ == "__main__":
    main()
