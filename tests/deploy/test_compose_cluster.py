"""docker-compose.yml deployed as written, on a namespace cluster (cluster.py),
running the tiny quickstart job to completion through the deployed controller.

Each Flywheel service of the active profile (cpu, from .env) starts with its
own command, environment, volumes and healthcheck as the file writes them,
in its own network namespace, in `depends_on` order with its conditions
(service_healthy: the healthcheck passes; service_completed_successfully:
the one-shot step exited 0), and the rollout service scaled to 2 replicas.

The only substitutions, each one what a container runtime would provide:
- the image's interpreter and files: its `python` is this virtualenv's (PATH,
  as the image's ENV puts /opt/venv/bin first), its installed packages are the
  repository's (PYTHONPATH), and the files the Dockerfile COPYs into it
  (the healthcheck script, examples/) are bound from the repository;
- the image's user (10001) is ignored: processes run as root;
- named and tmpfs volumes are directories; bind mounts are the repository's;
- the job and the model come from the file's own variables:
  FLYWHEEL_RUN_FILE=/etc/flywheel/examples/quickstart-tiny.yaml,
  FLYWHEEL_MODEL_SOURCE=tiny (unset, a user gets the quickstart on SmolLM2);
- not emulated: published host ports, restart policies, `init`, shm_size,
  ulimits; Prometheus and Grafana (images) do not run: the test scrapes every
  target prometheus.yml names, resolving its DNS names as Prometheus would,
  and checks the dashboard's queries against what those scrapes export.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.cluster import Host, NamespaceCluster, available
from tests.deploy.manifests import ROOT, image_files, load_compose, read_env_file
from tests.deploy.observe import check_dashboard, check_page_in_browser, live_status, replica_versions, replica_work, scrape

pytestmark = pytest.mark.slow

WHY_NOT = available()
VARIABLES = {
    **read_env_file(ROOT / ".env"),  # COMPOSE_PROFILES=cpu, as `docker compose up` reads it
    "FLYWHEEL_RUN_FILE": "/etc/flywheel/examples/quickstart-tiny.yaml",
    "FLYWHEEL_MODEL_SOURCE": "tiny",
}
#: Replicas per service (`--scale`); FLYWHEEL_TEST_ROLLOUT_SCALE=3 checks `--scale rollout=3`.
SCALE = {"rollout": int(os.environ.get("FLYWHEEL_TEST_ROLLOUT_SCALE", "2"))}
JOB_TIMEOUT = 780.0


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
    proc: subprocess.Popen | None = None
    healthy: bool = False
    next_check: float = 0.0

    @property
    def log(self) -> Path:
        return self.home / "log"

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class ComposeProject:
    def __init__(self, cluster: NamespaceCluster, root: Path, variables: dict[str, str]) -> None:
        self.cluster, self.root = cluster, root
        self.compose = load_compose(variables)
        profiles = set(filter(None, variables.get("COMPOSE_PROFILES", "").split(",")))
        self.services = {
            name: svc for name, svc in self.compose["services"].items()
            if (not svc.get("profiles") or profiles & set(svc["profiles"])) and "build" in svc  # Flywheel's image
        }
        self.volumes = {name: root / "volumes" / name for name in self.compose.get("volumes", {})}
        for path in self.volumes.values():
            path.mkdir(parents=True, exist_ok=True)
        self.containers: dict[str, list[Container]] = {}
        for service, spec in self.services.items():
            for i in range(1, SCALE.get(service, 1) + 1):
                name = f"{self.compose['name']}-{service}-{i}"
                aliases = [a for n in (spec.get("networks") or {}).values() if n for a in n.get("aliases", [])]
                host = cluster.add_host(name, names=[service, *aliases])
                home = root / "containers" / name
                home.mkdir(parents=True)
                c = Container(service, name, spec, host, home)
                c.env, c.mounts = self.environment(c), self.volume_mounts(spec)
                self.containers.setdefault(service, []).append(c)
        cluster.serve_names()

    # -- the container's view -------------------------------------------------
    def environment(self, c: Container) -> dict[str, str]:
        env = {
            # The image's ENV (Dockerfile), with the virtualenv and the installed package substituted.
            "PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "HOME": str(c.home), "HF_HOME": str(c.home / ".cache/huggingface"), "HOSTNAME": c.host.hostname,
        }
        for entry in c.spec.get("env_file", []):
            path = ROOT / (entry["path"] if isinstance(entry, dict) else entry)
            if path.exists():
                env.update(read_env_file(path))
            elif not (isinstance(entry, dict) and entry.get("required") is False):
                raise AssertionError(f"{c.name}: env_file {path} is missing")
        env.update({k: str(v) for k, v in (c.spec.get("environment") or {}).items()})
        return env

    def volume_mounts(self, spec: dict[str, Any]) -> dict[str, tuple[Path, bool]]:
        mounts = {target: (source, True) for target, source in image_files().items()}
        for entry in spec.get("volumes", []):
            source, target, *mode = entry.split(":")
            if source.startswith((".", "/")):
                path = (ROOT / source).resolve() if source.startswith(".") else Path(source)
            else:
                assert source in self.volumes, f"volume {source} is not declared"
                path = self.volumes[source]
            mounts[target] = (path, mode == ["ro"])
        return mounts

    # -- lifecycle ------------------------------------------------------------
    def start(self, c: Container) -> None:
        command = c.spec["command"]
        assert command[0] == "python", f"{c.name}: the image's interpreter is `python`"
        c.proc = self.cluster.run(c.host, command, env=c.env, mounts=c.mounts, cwd=c.home, log=c.log)

    def check_health(self, c: Container, now: float) -> None:
        hc = c.spec.get("healthcheck")
        if hc is None or c.healthy or now < c.next_check or c.proc is None or c.proc.poll() is not None:
            return
        c.next_check = now + duration(hc.get("interval", "30s"))
        test = hc["test"]
        assert test[0] == "CMD", f"{c.name}: healthcheck {test}"
        done = self.cluster.exec(c.proc, test[1:], env=c.env, timeout=duration(hc.get("timeout", "30s")))
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

    def up(self, until: float) -> None:
        """Starts everything in depends_on order; returns once every long-running service is healthy."""
        pending = [c for cs in self.containers.values() for c in cs]
        while True:
            now = time.monotonic()
            assert now < until, "deployment did not come up: " + ", ".join(
                f"{c.name} ({'started' if c.proc else 'waiting'}, healthy={c.healthy})" for c in pending)
            for c in list(pending):
                deps = c.spec.get("depends_on") or {}
                if all(self.condition_met(s, d.get("condition", "service_started"), d.get("required", True))
                       for s, d in deps.items()):
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


def prometheus_targets(cluster: NamespaceCluster) -> dict[str, list[str]]:
    """job -> the host:port addresses Prometheus would scrape (its dns_sd_configs, type A)."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {}
    for job in config["scrape_configs"]:
        found = []
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                found += [f"{address}:{sd['port']}" for address in cluster.resolve(name)]
        for static in job.get("static_configs", []):
            found += static["targets"]
        targets[job["job_name"]] = found
    return targets


@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
def test_compose_runs_the_job_with_two_replicas(tmp_path: Path) -> None:
    with NamespaceCluster(tmp_path) as cluster:
        project = ComposeProject(cluster, tmp_path, VARIABLES)
        assert set(project.containers) == {"model-init", "synchronizer", "trainer", "rollout", "controller"}
        deadline = time.monotonic() + JOB_TIMEOUT
        try:
            project.up(deadline)
            (controller,) = project.containers["controller"]
            ip = controller.host.address
            status_env = {k: v for k, v in controller.env.items() if k.startswith("FLYWHEEL_CONTROLLER__")}
            page = f"http://{ip}:{status_env['FLYWHEEL_CONTROLLER__STATUS_PORT']}/"

            # While the job runs: the status page shows every component, Prometheus's targets answer.
            body = {}
            while not body:
                assert controller.proc.poll() is None, f"controller exited early:\n{controller.tail()}"
                assert time.monotonic() < deadline
                try:
                    body = live_status(page, ["rollout"] * SCALE["rollout"] + ["trainer"])
                except OSError:
                    pass
                time.sleep(0.3)
            replica_ids = {c["id"] for c in body["components"] if c["role"] == "rollout"}
            scrapes = {}
            for job, targets in prometheus_targets(cluster).items():
                assert targets, f"prometheus job {job}: no target resolves"
                scrapes.update(scrape(targets))
            assert len(scrapes) == 3 + SCALE["rollout"]  # synchronizer, trainer, controller, each rollout
            check_dashboard(scrapes)
            check_page_in_browser(page, ["trainer-0", *replica_ids])

            code = controller.proc.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, controller.tail()
            # The replicas, still up, say themselves that they generated and moved to new weights.
            work = replica_work(prometheus_targets(cluster)["rollout"])
        finally:
            logs = {c.name: c.tail(1500) for cs in project.containers.values() for c in cs}
            cluster.stop()
        run_dir = project.volumes["flywheel-data"] / "runs" / "quickstart-tiny"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["last_step"] == 10 and summary["exit_code"] == 0, (summary, logs)
        # Every replica generated trained samples, and each did so on new weights.
        newest = replica_versions((run_dir / "trained_tasks.jsonl").read_text())
        assert set(newest) == replica_ids, (newest, replica_ids)
        assert all(version >= 5 for version in newest.values()), newest
        assert len(work) == SCALE["rollout"] and all(tokens > 0 and version >= 5 for tokens, version in work.values()), work

