"""What `docker compose up` does with docker-compose.yml, played on a namespace
cluster (cluster.py) for the deployment tests (test_compose_cluster.py):

    project = ComposeProject(cluster, tmp_path, variables, scale={"rollout": 2})
    project.up(deadline)          # depends_on order and conditions, healthchecks
    project.containers["trainer"] # [Container], each with its process, host and log

Each Flywheel service of the active profiles starts with its own command,
environment, volumes and healthcheck as the file writes them, in its own
network namespace, in `depends_on` order with its conditions
(service_healthy: the healthcheck passes; service_completed_successfully:
the one-shot step exited 0).

What a container runtime provides, played as Docker does:
- the image's user: processes (and healthchecks, as `docker exec`) run as
  the service's `user:` or else the Dockerfile's USER (image.py), HOME that
  user's home from the image, in a per-container copy owned as the image has
  it, starting in the image's WORKDIR;
- volumes (volumes.py): a named volume starts as the image's directory at its
  mount path (ownership included), root's 0755 where the image has none; a
  tmpfs volume takes its uid/gid/mode options; bind mounts are the host's
  files with the host's ownership;
- the image's interpreter and files: its `python` is this virtualenv's (PATH,
  as the image's ENV puts /opt/venv/bin first), its installed packages are the
  repository's (PYTHONPATH), and the files the Dockerfile COPYs into it
  (the healthcheck script, examples/) are bound from the repository.
Every service field is checked against fields.py first: one that is neither
played nor listed there as a no-op (published ports, restart policies, init,
shm_size, ulimits... with the reason for each) fails, naming it. Prometheus
and Grafana (other images) do not run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tests.deploy.cluster import Host, NamespaceCluster
from tests.deploy.fields import check_compose_service, check_compose_volume
from tests.deploy.image import Identity, image_directories, image_home, image_user, image_workdir
from tests.deploy.manifests import ROOT, image_files, load_compose, read_env_file
from tests.deploy.volumes import docker_named_volume, docker_tmpfs_options, make_directory

def duration(text: str) -> float:
    """Compose durations: 5s, 1m30s, 600s."""
    total = 0.0
    for amount, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text):
        total += float(amount) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


@dataclass
class Container:
    service: str
    name: str
    spec: dict[str, Any]
    host: Host
    home: Path
    env: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, tuple[Path, bool]] = field(default_factory=dict)
    user: Identity = Identity(0, 0)
    proc: subprocess.Popen | None = None
    healthy: bool = False
    next_check: float = 0.0

    @property
    def log(self) -> Path:
        return self.home / "log"

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class ComposeProject:
    def __init__(self, cluster: NamespaceCluster, root: Path, variables: dict[str, str],
                 scale: dict[str, int] | None = None, compose: dict[str, Any] | None = None) -> None:
        """`compose`: the parsed file to play (default: docker-compose.yml with `variables`)."""
        self.cluster, self.root = cluster, root
        self.compose = compose if compose is not None else load_compose(variables)
        profiles = set(filter(None, variables.get("COMPOSE_PROFILES", "").split(",")))
        self.services = {
            name: svc for name, svc in self.compose["services"].items()
            if (not svc.get("profiles") or profiles & set(svc["profiles"])) and "build" in svc  # Flywheel's image
        }
        # Before anything is made: a field nobody plays fails here, naming it.
        for name, spec in self.services.items():
            check_compose_service(spec, f"compose service {name}")
        for name, spec in (self.compose.get("volumes") or {}).items():
            check_compose_volume(spec, f"compose volume {name}")
        self.volumes = {name: root / "volumes" / name for name in self.compose.get("volumes", {})}
        self._initialised: set[str] = set()
        self.containers: dict[str, list[Container]] = {}
        for service, spec in self.services.items():
            for i in range(1, (scale or {}).get(service, 1) + 1):
                name = f"{self.compose['name']}-{service}-{i}"
                aliases = [a for n in (spec.get("networks") or {}).values() if n for a in n.get("aliases", [])]
                host = cluster.add_host(name, names=[service, *aliases], hostname=spec.get("hostname"))
                home = root / "containers" / name
                home.mkdir(parents=True)
                c = Container(service, name, spec, host, home)
                c.user = self.identity(spec)
                c.env, c.mounts = self.environment(c), self.volume_mounts(c)
                self.containers.setdefault(service, []).append(c)
        cluster.serve_names()

    # -- the image --------------------------------------------------------------
    @staticmethod
    def target(spec: dict[str, Any]) -> str:
        return spec["build"]["target"]

    def identity(self, spec: dict[str, Any]) -> Identity:
        """`user: uid[:gid]`, else the image's USER. A uid without a group gets the image's group
        for the image's user and root's otherwise, as the runtime reads the image's /etc/passwd."""
        image = image_user(self.target(spec))
        if "user" not in spec:
            return image
        uid, _, gid = str(spec["user"]).partition(":")
        assert uid.isdigit() and (not gid or gid.isdigit()), f"user {spec['user']}: only numeric users are played"
        return Identity(int(uid), int(gid) if gid else image.gid if int(uid) == image.uid else 0)

    # -- the container's view -------------------------------------------------
    def environment(self, c: Container) -> dict[str, str]:
        env = {
            # The image's ENV (Dockerfile), with the virtualenv and the installed package substituted.
            "PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            # HOME from the image's /etc/passwd: its user's home, "/" for any other uid.
            "HOME": self.home(c) if c.user.uid == image_user(self.target(c.spec)).uid else "/",
            "HF_HOME": f"{self.home(c)}/.cache/huggingface", "HOSTNAME": c.host.hostname,
        }
        for entry in c.spec.get("env_file", []):
            path = ROOT / (entry["path"] if isinstance(entry, dict) else entry)
            if path.exists():
                env.update(read_env_file(path))
            elif not (isinstance(entry, dict) and entry.get("required") is False):
                raise AssertionError(f"{c.name}: env_file {path} is missing")
        env.update({k: str(v) for k, v in (c.spec.get("environment") or {}).items()})
        return env

    def home(self, c: Container) -> str:
        return image_home(self.target(c.spec))

    def volume_mounts(self, c: Container) -> dict[str, tuple[Path, bool]]:
        target_stage = self.target(c.spec)
        mounts = {target: (source, True) for target, source in image_files().items()}
        # The container's own copy of the image's home directory (its writable layer), owned as the image has it.
        home = self.home(c)
        mounts[home] = (make_directory(c.home / "home", image_directories(target_stage)[home]), False)
        for entry in c.spec.get("volumes", []):
            assert isinstance(entry, str), f"{c.name}: volume {entry}: only the short syntax is played"
            source, target, *mode = entry.split(":")
            assert mode in ([], ["ro"], ["rw"]), f"{c.name}: volume {entry}: mode {mode} is not played"
            if source.startswith((".", "/")):  # a bind mount: the host's files and ownership
                path = (ROOT / source).resolve() if source.startswith(".") else Path(source)
            else:
                assert source in self.volumes, f"volume {source} is not declared"
                path = self.volumes[source]
                if source not in self._initialised:  # first mount of a new volume: from the image
                    self._initialised.add(source)
                    options = ((self.compose["volumes"][source] or {}).get("driver_opts") or {}).get("o", "")
                    tmpfs = docker_tmpfs_options(options)
                    if tmpfs is not None:
                        make_directory(path, tmpfs)
                    else:
                        docker_named_volume(path, image_directories(target_stage).get(target),
                                            image_files().get(target))
            mounts[target] = (path, mode == ["ro"])
        # File secrets (docker compose without swarm): the host's file bound read-only, the host's ownership.
        for entry in c.spec.get("secrets", []):
            source = entry["source"] if isinstance(entry, dict) else entry
            target = entry.get("target", source) if isinstance(entry, dict) else source
            declared = (self.compose.get("secrets") or {}).get(source)
            assert declared and set(declared) == {"file"}, f"{c.name}: secret {source}: only file secrets are played"
            file = Path(declared["file"])
            mounts[target if target.startswith("/") else f"/run/secrets/{target}"] = (
                (ROOT / file).resolve() if not file.is_absolute() else file, True)
        return mounts

    # -- lifecycle ------------------------------------------------------------
    def start(self, c: Container) -> None:
        command = c.spec["command"]
        assert command[0] == "python", f"{c.name}: the image's interpreter is `python`"
        c.proc = self.cluster.run(c.host, command, env=c.env, mounts=c.mounts, log=c.log, user=c.user,
                                  cwd=Path(image_workdir(self.target(c.spec))))

    def check_health(self, c: Container, now: float) -> None:
        hc = c.spec.get("healthcheck")
        if hc is None or c.healthy or now < c.next_check or c.proc is None or c.proc.poll() is not None:
            return
        c.next_check = now + duration(hc.get("interval", "30s"))
        test = hc["test"]
        assert test[0] == "CMD", f"{c.name}: healthcheck {test}"
        done = self.cluster.exec(c.proc, test[1:], env=c.env, timeout=duration(hc.get("timeout", "30s")), user=c.user)
        c.healthy = done.returncode == 0

    def condition_met(self, service: str, condition: str, required: bool) -> bool:
        if service not in self.containers:
            assert not required, f"depends_on {service}: no such service in the active profile"
            return True
        for c in self.containers[service]:
            if c.proc is None:
                return False
            code = c.proc.poll()
            if condition == "service_completed_successfully":
                if code is None:
                    return False
                assert code == 0, f"{c.name} exited {code}:\n{c.tail()}"
            elif condition == "service_healthy":
                if not c.healthy:
                    return False
        return True

    def up(self, until: float, before_start: Callable[[Container], None] = lambda c: None) -> None:
        """Starts everything in depends_on order, calling `before_start` with each container just before
        it starts; returns once every long-running service is healthy."""
        pending = [c for cs in self.containers.values() for c in cs]
        while True:
            now = time.monotonic()
            assert now < until, "deployment did not come up: " + ", ".join(
                f"{c.name} ({'started' if c.proc else 'waiting'}, healthy={c.healthy})" for c in pending)
            for c in list(pending):
                deps = c.spec.get("depends_on") or {}
                if all(self.condition_met(s, d.get("condition", "service_started"), d.get("required", True))
                       for s, d in deps.items()):
                    before_start(c)
                    self.start(c)
                    pending.remove(c)
            for cs in self.containers.values():
                for c in cs:
                    if c.proc is not None and c.proc.poll() is not None and c.spec.get("restart") != "no":
                        raise AssertionError(f"{c.name} exited {c.proc.returncode}:\n{c.tail()}")
                    self.check_health(c, now)
            if not pending and all(c.healthy or c.spec.get("restart") == "no"
                                   for cs in self.containers.values() for c in cs):
                return
            time.sleep(0.5)


