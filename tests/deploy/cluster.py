"""The nearest thing to a container host these machines allow: one network
namespace per container, joined by a bridge, names answered by a DNS server
on the bridge (as Docker's embedded DNS and CoreDNS answer them), volumes
bind-mounted at the paths the container sees.

    with NamespaceCluster(tmp_path) as cluster:
        host = cluster.add_host("flywheel-rollout-1", names=["rollout"])
        cluster.serve_names()              # every host's names, from every namespace
        proc = cluster.run(host, argv, env=..., mounts={"/models": dir}, cwd=home, log=path,
                           user=Identity(10001, 10001))
        cluster.exec(proc, argv, env=..., user=...)  # like `docker exec`: the process's namespaces
        sock = connect_from(host.netns, address, port, timeout=2)  # a TCP connection made as that host

Each process runs under `ip netns exec NS unshare --uts --mount`: its own
hostname (a container id, as Docker gives) and a private mount namespace in
which the volumes are bound, so nothing is mounted on the host. The mount
points themselves must exist on the host: missing ones are created (empty)
and removed again at the end. Then it becomes the container's user with
util-linux `setpriv` (uid, gid, supplementary groups; no_new_privs and an
empty capability bounding set where the manifest asks), as runc does before
it execs the entrypoint: what that user may read and write is what the
volumes' ownership allows, as on a real host. Needs root and iproute2;
`available()` says why not otherwise.

The image's interpreter, virtualenv and code are this machine's: where one
lives under a directory other users cannot enter (pyenv's under /root, 0700;
a clone in a private home), the container's mount namespace gets a
world-traversable tmpfs over that directory with only those bound back into
it, as the image carries them where every user reaches them. Nothing on the
host changes.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import os
import secrets
import shlex
import shutil
import signal
import socket
import struct
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from tests.deploy.image import Identity

NETNS_ETC = Path("/etc/netns")
#: Mount points made on the host for containers' volumes (/opt/flywheel/...), shared by every cluster alive on
#: this machine: each live cluster holds a shared lock, and the last to end removes the paths listed.
MOUNT_POINTS_LOCK = Path("/tmp/flywheel-test-mount-points.lock")
MOUNT_POINTS_MADE = Path("/tmp/flywheel-test-mount-points.made")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


#: Every emulated host runs on this machine's two cores, where a real cluster gives each pod its own:
#: the test session's OpenMP wait policy (idle threads asleep, set and measured in tests/conftest.py)
#: goes to every container, whose environment is otherwise the image's and the manifest's alone.
SHARED_CORES_VARIABLES = ("OMP_WAIT_POLICY",)


def available() -> str:
    """'' when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, bind mounts)"
    for tool in ("ip", "unshare", "nsenter", "mount", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} not found (iproute2 / util-linux)"
    probe = f"fwprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _unreachable_ancestor(path: Path) -> Path | None:
    """The outermost directory on `path` that other users cannot traverse (no o+x), if any."""
    for ancestor in reversed([path, *path.parents]):
        if ancestor.is_dir() and not ancestor.stat().st_mode & stat.S_IXOTH:
            return ancestor
    return None


def process_identity(pid: int) -> dict:
    """Who a running process is, from /proc/PID/status: its uid and gid (real, effective, saved and
    filesystem ids all equal, else the differing ids are shown) and supplementary groups."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    uids, gids = set(status["Uid"].split()), set(status["Gid"].split())
    return {"uid": int(uids.pop()) if len(uids) == 1 else status["Uid"].split(),
            "gid": int(gids.pop()) if len(gids) == 1 else status["Gid"].split(),
            "groups": tuple(sorted(int(g) for g in status["Groups"].split()))}


def process_privileges(pid: int) -> dict:
    """no_new_privs and the capability bounding set (hex) of a running process."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"no_new_privs": status["NoNewPrivs"].strip() == "1", "bounding_set": int(status["CapBnd"].strip(), 16)}


class GenerationHold:
    """Holds the rollout replicas' generation while a test looks at a live job, and nothing else of them.

    A job of the tiny model ran its 20 steps in 8 s on a fast 2-core machine, before the status page had
    answered (CI at 5887148), so a test that polled for a job in progress raced its end. `hold(pids)` stops
    (SIGSTOP) every process below each replica's main process: vLLM's engine core, which does the
    generation, and multiprocessing's resource tracker. The main process keeps serving its gRPC and HTTP
    APIs, health, metrics and registration, so the replica is up and ready but no token comes out: the
    job's first rollouts wait (within worker.timeout_seconds) and its step stays at 0 until `release()`.
    A replica whose engine runs in its own process only (the transformers engine) has nothing to hold:
    `hold` refuses it, so the test cannot pass unheld."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def hold(self, pids: list[int]) -> None:
        for pid in pids:
            below = psutil.Process(pid).children(recursive=True)
            assert below, f"process {pid} has no child process to hold (its engine runs in process)"
            for child in below:
                child.send_signal(signal.SIGSTOP)
                self.held.append(child.pid)

    def release(self) -> None:
        for pid in self.held:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.held.clear()


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def socket_in(netns: str | None, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A new IPv4 socket of a network namespace (None: this one). setns moves only the calling
    thread, and a socket stays in the namespace it was made in: the thread makes it there and
    comes back at once, so this process can connect from a pod's address, as that pod."""
    if netns is None:
        return socket.socket(socket.AF_INET, kind)
    with open("/proc/thread-self/ns/net") as home, open(f"/var/run/netns/{netns}") as there:
        _setns(there.fileno())
        try:
            return socket.socket(socket.AF_INET, kind)
        finally:
            _setns(home.fileno())


def connect_from(netns: str | None, address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection made from inside a network namespace (a pod's, or None for the node)."""
    sock = socket_in(netns)
    sock.settimeout(timeout)
    try:
        sock.connect((address, port))
    except OSError:
        sock.close()
        raise
    return sock


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str  # the container's name, e.g. flywheel-rollout-1
    netns: str
    address: str
    hostname: str  # what `hostname` says inside, like a Docker container id
    names: list[str] = field(default_factory=list)  # service names and aliases that resolve to it


class NamespaceCluster:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.tag = secrets.token_hex(2)
        # A /24 unlikely to collide with this machine's networks or another run's.
        self.subnet = ipaddress.ip_network(f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}.0/24")
        self.bridge = f"fwbr{self.tag}"
        self.gateway = str(self.subnet.network_address + 1)
        self.hosts: list[Host] = []
        self.processes: list[subprocess.Popen] = []
        self._mount_points_held = None
        self._addresses: list[str] = []
        self._lock = threading.Lock()
        self._dns: DnsServer | None = None

    # -- network ----------------------------------------------------------------
    def __enter__(self) -> NamespaceCluster:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add_host(self, name: str, names: list[str], hostname: str | None = None) -> Host:
        index = len(self.hosts)
        netns = f"fw{self.tag}-{index}"
        address = str(self.subnet.network_address + 10 + index)
        outside, inside = f"fw{self.tag}h{index}", f"fw{self.tag}c{index}"
        _ip("netns", "add", netns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("link", "set", inside, "netns", netns)
        for args in (("link", "set", "lo", "up"), ("addr", "add", f"{address}/24", "dev", inside),
                     ("link", "set", inside, "up"), ("route", "add", "default", "via", self.gateway)):
            _ip("-n", netns, *args)
        host = Host(name=name, netns=netns, address=address, hostname=hostname or secrets.token_hex(6),
                    names=list(names))
        self.hosts.append(host)
        return host

    def resolve(self, name: str) -> list[str]:
        """Every address `name` resolves to (a scaled service: one per replica)."""
        return [h.address for h in self.hosts if name.lower() in (h.name, h.hostname, *h.names)]

    def serve_names(self) -> None:
        """Docker's view: each container's /etc/hosts holds only itself; every host's name,
        hostname (its container id) and aliases are answered by a DNS server on the bridge.
        (A shared hosts file is no substitute: gRPC's c-ares resolver answers every name
        of such a file with the first line's address when the lines share an alias.)"""
        for h in self.hosts:
            self.write_etc(h, hosts=["127.0.0.1 localhost", "::1 localhost ip6-localhost", f"{h.address} {h.hostname}"],
                           resolv=[f"nameserver {self.gateway}", "options ndots:0"])
        self._dns = DnsServer(self.gateway, lambda name: self.resolve(name) or None)

    def write_etc(self, host: Host, hosts: list[str], resolv: list[str]) -> None:
        """/etc/netns/<ns>/{hosts,resolv.conf,hostname}, which `ip netns exec` binds over /etc."""
        etc = NETNS_ETC / host.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text("\n".join(hosts) + "\n")
        (etc / "resolv.conf").write_text("\n".join(resolv) + "\n")
        (etc / "hostname").write_text(host.hostname + "\n")

    def add_address(self) -> str:
        """One more address on the bridge, owned by this (the root) namespace: a Service's
        virtual IP, which every namespace reaches through its default route."""
        address = str(self.subnet.network_address + 200 + len(self._addresses))
        _ip("addr", "add", f"{address}/32", "dev", self.bridge)
        self._addresses.append(address)
        return address

    # -- processes ------------------------------------------------------------
    def _mount_point(self, target: Path, is_file: bool) -> None:
        with self._lock:  # containers may start from several threads
            if self._mount_points_held is None:  # one share of the host's mount points while this cluster lives
                self._mount_points_held = open(MOUNT_POINTS_LOCK, "a")
                fcntl.flock(self._mount_points_held, fcntl.LOCK_SH)
            missing = [p for p in [target, *target.parents] if not p.exists()]
            for path in reversed(missing):
                if path == target and is_file:
                    path.touch()
                else:
                    path.mkdir()
            if missing:
                with open(MOUNT_POINTS_MADE, "a") as made:
                    made.writelines(f"{path}\n" for path in reversed(missing))

    def _remove_mount_points(self) -> None:
        """The host's mount points go with the last cluster that uses them: clusters in other processes
        (make test's two workers) may be starting containers on the same paths (/opt/flywheel/...), and a
        mount point removed under one fails its mount ("mount point is busy")."""
        held, self._mount_points_held = self._mount_points_held, None
        if held is None:
            return
        with held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # from shared: no other cluster holds a share
            except BlockingIOError:
                return  # the last one removes them
            try:
                made = [Path(line) for line in MOUNT_POINTS_MADE.read_text().splitlines() if line]
            except FileNotFoundError:
                made = []
            for path in reversed(list(dict.fromkeys(made))):
                try:
                    path.unlink() if path.is_file() else path.rmdir()
                except OSError:
                    pass
            MOUNT_POINTS_MADE.unlink(missing_ok=True)

    def _reachable_steps(self) -> list[str]:
        """Mount steps that let any user reach the interpreter, the virtualenv and the repository
        (PYTHONPATH) where they lie under a directory other users cannot enter (see the module doc)."""
        from tests.deploy.manifests import ROOT

        needed = sorted({Path(p).resolve() for p in (sys.base_prefix, sys.prefix, ROOT)})
        needed = [p for p in needed if not any(q != p and q in p.parents for q in needed)]
        q = lambda path: shlex.quote(str(path))  # noqa: E731
        staged: list[tuple[Path, Path, Path]] = []
        steps: list[str] = []
        for index, path in enumerate(needed):
            hidden = _unreachable_ancestor(path)
            if hidden is None:
                continue
            stage = self.workdir / f".reachable-{index}"
            stage.mkdir(exist_ok=True)
            steps.append(f"mount --bind {q(path)} {q(stage)}")
            staged.append((hidden, path, stage))
        for hidden in dict.fromkeys(hidden for hidden, _, _ in staged):
            steps.append(f"mount -t tmpfs -o mode=0755 tmpfs {q(hidden)}")
        for _, path, stage in staged:
            steps += [f"mkdir -p {q(path)}", f"mount --move {q(stage)} {q(path)}"]
        return steps

    def _prologue(self, host: Host, mounts: dict[str, tuple[Path, bool]], cwd: Path | None, user: Identity) -> str:
        steps = [f"hostname {shlex.quote(host.hostname)}", *self._reachable_steps()]
        for target, (source, read_only) in mounts.items():
            self._mount_point(Path(target), Path(source).is_file())
            steps.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}")
            if read_only:
                steps.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        if cwd is not None:
            steps.append(f"cd {shlex.quote(str(cwd))}")
        return " && ".join(steps) + f' && exec {shlex.join(user.setpriv())} "$@"'

    def run(
        self, host: Host, argv: list[str], *, env: dict[str, str], mounts: dict[str, tuple[Path, bool]],
        cwd: Path, log: Path, user: Identity,
    ) -> subprocess.Popen:
        """Starts `argv` as the container's main process, as `user` (its PID is the Popen's: every step execs)."""
        wrapper = ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "--propagation", "private",
                   "sh", "-c", self._prologue(host, mounts, cwd, user), "sh", *argv]
        with log.open("ab") as out:
            shared = {k: os.environ[k] for k in SHARED_CORES_VARIABLES if k in os.environ}
            proc = subprocess.Popen(wrapper, env={**shared, **env}, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(proc)
        return proc

    def exec(self, proc: subprocess.Popen, argv: list[str], *, env: dict[str, str], timeout: float, user: Identity
             ) -> subprocess.CompletedProcess:
        """Runs `argv` inside `proc`'s network, mount and UTS namespaces as `user`, like `docker exec`
        (and the kubelet's exec probes), which run as the container's user."""
        # --wd: the container process's working directory (its WORKDIR), as `docker exec` starts there.
        wrapper = ["nsenter", "--target", str(proc.pid), "--net", "--mount", "--uts", "--wd", *user.setpriv(), *argv]
        try:
            return subprocess.run(wrapper, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(wrapper, 124, exc.stdout or "", "timed out")

    # -- teardown -------------------------------------------------------------
    def stop(self, grace: float = 20.0) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._dns is not None:
            self._dns.close()
        for h in self.hosts:
            # Whatever a service left running in the namespace (engine workers) goes with it.
            pids = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True)
            shutil.rmtree(NETNS_ETC / h.netns, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self._remove_mount_points()


class DnsServer:
    """A minimal DNS server on UDP port 53 of `address`, in this (the root) namespace.

    `records(name)` gives a name's IPv4 addresses, or None when the name does not exist:
    the answer is then NXDOMAIN, so a resolver goes on to its next search domain. AAAA
    and other queries for an existing name get an empty answer (NODATA). TTLs are 5 s.
    """

    def __init__(self, address: str, records: Callable[[str], list[str] | None]) -> None:
        self.records = records
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((address, 53))
        self._sock.settimeout(0.5)
        self._closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                query, peer = self._sock.recvfrom(512)
            except OSError:  # timeout, or closed
                continue
            try:
                self._sock.sendto(self.answer(query), peer)
            except (ValueError, IndexError, struct.error, OSError):
                continue

    def answer(self, query: bytes) -> bytes:
        (ident,) = struct.unpack(">H", query[:2])
        labels, at = [], 12
        while query[at]:
            labels.append(query[at + 1: at + 1 + query[at]].decode().lower())
            at += 1 + query[at]
        qtype, _qclass = struct.unpack(">HH", query[at + 1: at + 5])
        addresses = self.records(".".join(labels))
        answers = [struct.pack(">HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(a)
                   for a in addresses or []] if qtype == 1 else []
        rcode = 3 if addresses is None else 0
        header = struct.pack(">HHHHHH", ident, 0x8180 | rcode, 1, len(answers), 0, 0)
        return header + query[12: at + 5] + b"".join(answers)

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
