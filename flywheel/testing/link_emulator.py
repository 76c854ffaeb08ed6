"""An emulated slow, lossy link for tests and benches (these machines have no netem).

Two network namespaces, `near` and `far`, joined by two TUN devices whose
packets pass through this process: each IP packet is dropped at random
(`loss`), queued behind the packets before it at the link's rate (a drop-tail
queue of `queue_seconds` of traffic, as a router's), and delivered `delay`
seconds after it left the queue. The endpoints are real kernel TCP stacks, so
what a transfer sees is what it would see on such a link: slow start,
retransmissions and congestion control included, which a user-space TCP
proxy (two shorter connections, no loss) would hide.

    with EmulatedLink(rate_bits=100e6, delay=0.020, loss=0.001) as link:   # 40 ms round trip
        server = link.popen("far", [python, "-m", "...", "--host", link.far_address])
        client = link.popen("near", [python, ...])
        link.cut(5.0)        # the link goes dark for 5 s (every packet dropped), then comes back
        link.stats()         # packets and bytes forwarded, dropped by loss, by the queue, by cuts

`delay` is one way; the round trip is twice it. Needs root, iproute2 and
/dev/net/tun; `available()` says why not otherwise.
"""

from __future__ import annotations

import collections
import fcntl
import os
import random
import secrets
import shutil
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
#: MTU of the emulated link: Ethernet's, so TCP segments are the size they are on a real path.
MTU = 1500


def available() -> str:
    """'' when the link can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    if shutil.which("ip") is None:
        return "ip not found (iproute2)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun missing"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


@dataclass
class LinkStats:
    forwarded_packets: int = 0
    forwarded_bytes: int = 0
    lost: int = 0  # dropped at random (loss)
    queue_drops: int = 0  # dropped because the queue was full (the link's rate)
    cut_drops: int = 0  # dropped while the link was cut


@dataclass
class _Direction:
    """One way of the link: packets read from `source`, written to `sink` on time."""

    source: int
    sink: int
    stats: LinkStats = field(default_factory=LinkStats)
    queue: collections.deque = field(default_factory=collections.deque)  # (deliver_at, packet)
    ready: threading.Condition = field(default_factory=threading.Condition)
    free_at: float = 0.0  # when the link finishes sending what is queued: its backlog, in time


class EmulatedLink:
    def __init__(self, rate_bits: float, delay: float, loss: float = 0.0, queue_seconds: float = 0.1,
                 seed: int = 0) -> None:
        if rate_bits <= 0 or delay < 0 or not 0 <= loss < 1 or queue_seconds <= 0:
            raise ValueError("need rate_bits > 0, delay >= 0, 0 <= loss < 1, queue_seconds > 0")
        self.rate_bits, self.delay, self.loss = rate_bits, delay, loss
        self.queue_bytes = max(64 * MTU, int(rate_bits / 8 * queue_seconds))
        self._random = random.Random(seed)
        self.tag = secrets.token_hex(3)
        self.namespaces = {"near": f"fwnear{self.tag}", "far": f"fwfar{self.tag}"}
        octet = 100 + secrets.randbelow(100)
        self.near_address, self.far_address = f"10.{octet}.{secrets.randbelow(250)}.1", ""
        self.far_address = self.near_address[:-1] + "2"
        self._cut_until = 0.0
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._fds: list[int] = []
        self._directions: list[_Direction] = []
        self.processes: list[subprocess.Popen] = []

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> EmulatedLink:
        reason = available()
        if reason:
            raise RuntimeError(f"cannot emulate a link here: {reason}")
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _build(self) -> None:
        ends = {"near": (f"fwn{self.tag}", self.near_address, self.far_address),
                "far": (f"fwf{self.tag}", self.far_address, self.near_address)}
        fds = {}
        for side, (device, address, peer) in ends.items():
            ns = self.namespaces[side]
            _ip("netns", "add", ns)
            fds[side] = _open_tun(device)
            self._fds.append(fds[side])
            _ip("link", "set", device, "netns", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", address, "peer", peer, "dev", device)
            _ip("-n", ns, "link", "set", device, "mtu", str(MTU), "up")
        self._directions = [_Direction(fds["near"], fds["far"]), _Direction(fds["far"], fds["near"])]
        for direction in self._directions:
            for target in (self._receive, self._deliver):
                thread = threading.Thread(target=target, args=(direction,), daemon=True,
                                          name=f"link-{target.__name__}")
                thread.start()
                self._threads.append(thread)

    def close(self) -> None:
        self._stopping = True
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for direction in self._directions:
            with direction.ready:
                direction.ready.notify_all()
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for fd in self._fds:  # after the namespaces: closing a TUN fd wakes its reader with an error
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        for thread in self._threads:
            thread.join(timeout=5)

    # -- use ----------------------------------------------------------------------------------

    def command(self, side: str, argv: list[str]) -> list[str]:
        """`argv` run inside the `side` ("near" or "far") namespace."""
        return ["ip", "netns", "exec", self.namespaces[side], *argv]

    def popen(self, side: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """A process inside one end's namespace, killed when the link closes."""
        proc = subprocess.Popen(self.command(side, argv), **kwargs)
        self.processes.append(proc)
        return proc

    def cut(self, seconds: float) -> None:
        """The link goes dark for `seconds` from now: every packet either way is dropped."""
        self._cut_until = time.monotonic() + seconds

    def stats(self) -> dict[str, LinkStats]:
        """Per direction: "near->far" and "far->near"."""
        return {"near->far": self._directions[0].stats, "far->near": self._directions[1].stats}

    # -- the forwarder ------------------------------------------------------------------------

    def _receive(self, d: _Direction) -> None:
        seconds_per_byte = 8.0 / self.rate_bits
        while not self._stopping:
            try:
                packet = os.read(d.source, 65536)
            except OSError:
                return
            now = time.monotonic()
            if now < self._cut_until:
                d.stats.cut_drops += 1
                continue
            if self.loss and self._random.random() < self.loss:
                d.stats.lost += 1
                continue
            with d.ready:
                # What waits to be sent is the backlog's time at the link's rate; what is in flight
                # (the delay) is not queued.
                backlog = max(0.0, d.free_at - now) / seconds_per_byte
                if backlog + len(packet) > self.queue_bytes:
                    d.stats.queue_drops += 1
                    continue
                d.free_at = max(now, d.free_at) + len(packet) * seconds_per_byte
                d.queue.append((d.free_at + self.delay, packet))
                d.ready.notify()

    def _deliver(self, d: _Direction) -> None:
        while not self._stopping:
            with d.ready:
                while not d.queue and not self._stopping:
                    d.ready.wait(0.5)
                if self._stopping:
                    return
                deliver_at = d.queue[0][0]
            wait = deliver_at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            now = time.monotonic()
            due = []
            with d.ready:
                while d.queue and d.queue[0][0] <= now:
                    due.append(d.queue.popleft()[1])
            for packet in due:
                try:
                    os.write(d.sink, packet)
                except OSError:
                    if self._stopping:
                        return
                    continue  # the kernel refused one packet (its queue full): lost, as on a wire
                d.stats.forwarded_packets += 1
                d.stats.forwarded_bytes += len(packet)
