"""A pod as the emulated kubelet (kube.py) keeps it: its containers' processes, probe counts and
restarts, and one run of a probe, as the kubelet runs it from the node to the pod IP.

Probes: grpc (grpc.health.v1 Check, no credentials), httpGet, tcpSocket and
exec (in the container, with its environment, as the container's user); a
probe of another kind fails the test, naming it.
"""

from __future__ import annotations

import socket
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy.cluster import Host, NamespaceCluster
from tests.deploy.image import Identity

#: What a probe's unset fields are (the Kubernetes API's defaults).
PROBE_DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "timeoutSeconds": 1,
                  "successThreshold": 1, "failureThreshold": 3}


@dataclass
class Container:
    spec: dict[str, Any]
    proc: subprocess.Popen | None = None
    started: bool = False  # the startup probe passed (or there is none)
    ready: bool = False
    restarts: int = 0
    exit_code: int | None = None
    counts: dict[str, list[int]] = field(default_factory=dict)  # probe -> [successes, failures] in a row
    due: dict[str, float] = field(default_factory=dict)  # probe -> next run (monotonic)

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass
class Pod:
    name: str
    owner: dict[str, Any]  # the workload
    spec: dict[str, Any]  # the pod template's spec
    labels: dict[str, str]
    annotations: dict[str, str]
    host: Host
    home: Path
    subdomain: str = ""
    containers: list[Container] = field(default_factory=list)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # container name -> its environment
    users: dict[str, Identity] = field(default_factory=dict)  # container name -> who it runs as
    phase: str = "Pending"  # Pending, Running, Succeeded, Failed
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.home / "log"

    @property
    def ip(self) -> str:
        return self.host.address

    @property
    def ready(self) -> bool:
        return self.phase == "Running" and all(c.ready for c in self.containers)

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.containers)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def why_restarted(self, n: int = 3000) -> str:
        """What `kubectl describe pod` and `kubectl logs --previous` show: every start, restart and failed
        probe of its containers, then the end of the log before the first restart."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        events = [line for line in text.splitlines() if line.startswith("--- ")]
        first = text.find(": restart 1 (")
        before = text[:text.rfind("\n", 0, first) + 1] if first >= 0 else text
        return "\n".join(events) + "\n... before the first restart:\n" + before[-n:]


def container_port(pod: Pod, port: int | str) -> int:
    """A container port of the pod, by number or by name."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for c in pod.spec["containers"]:
        for p in c.get("ports", []):
            if p.get("name") == port:
                return p["containerPort"]
    raise AssertionError(f"{pod.name}: no container port named {port}")


def probe_once(cluster: NamespaceCluster, pod: Pod, c: Container, probe: dict[str, Any]) -> bool:
    """One run of `probe` (PROBE_DEFAULTS filled in) against container `c`, as the kubelet runs it from
    the node: whether it passed. An exec probe's failure is written to the pod's log, as `kubectl
    describe pod` shows it."""
    timeout = probe["timeoutSeconds"]
    try:
        if "grpc" in probe:
            target = f"{pod.ip}:{container_port(pod, probe['grpc']['port'])}"
            with grpc.insecure_channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://{pod.ip}:{container_port(pod, get['port'])}{get.get('path', '/')}"
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                return 200 <= reply.status < 400
        if "tcpSocket" in probe:
            port = container_port(pod, probe["tcpSocket"]["port"])
            with socket.create_connection((pod.ip, port), timeout=timeout):
                return True
        if "exec" in probe:
            assert c.proc is not None
            done = cluster.exec(c.proc, probe["exec"]["command"], env=pod.envs[c.name], timeout=timeout,
                                     user=pod.users[c.name])
            if done.returncode != 0:  # what `kubectl describe pod` shows for a failed exec probe
                output = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o or ""
                                 for o in (done.stdout, done.stderr))
                with pod.log.open("a") as out:
                    out.write(f"--- {c.name}: probe failed ({done.returncode}): {output.strip()[-300:]}\n")
            return done.returncode == 0
    except (grpc.RpcError, OSError):
        return False
    raise AssertionError(f"{pod.name}/{c.name}: a probe of a kind this emulation does not run: {probe}")
