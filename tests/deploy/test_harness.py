"""The deployment harness itself (cluster.py, kube.py, compose.py): it plays the
image's user and the volumes' ownership as Docker and the kubelet do, and it
refuses any manifest field it neither plays nor lists as a no-op (fields.py).
Quick: no service starts, except one small process on a namespace cluster."""

from __future__ import annotations

import copy
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.cluster import Host, NamespaceCluster, available, process_identity, process_privileges
from tests.deploy.compose import ComposeProject
from tests.deploy.fields import IMPLEMENTED, NO_OPS, check_compose_service, check_compose_volume, check_workload
from tests.deploy.image import Identity, image_directories, image_user
from tests.deploy.kube import Kube
from tests.deploy.pods import Pod
from tests.deploy.manifests import (ROOT, WORKLOAD_KINDS, KUSTOMIZE_ROOT, load_compose, read_env_file, render,
                                    render_overlay, user_overlay, workloads)

WHY_NOT = available()
VARIABLES = {**read_env_file(ROOT / ".env")}
COMPOSE_OVERRIDES = sorted((ROOT / "deploy" / "compose").glob("docker-compose.*.yml"))
USER = image_user("cpu")


def owner_and_mode(path: Path) -> tuple[int, int, int]:
    info = path.stat()
    return info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)


class NoNetwork:
    """Stands in for a NamespaceCluster where a test looks only at what a project prepares."""

    def add_host(self, name: str, names: list[str], hostname: str | None = None) -> Host:
        return Host(name, "none", "127.0.0.1", hostname or name, names)

    def serve_names(self) -> None:
        pass


# ---------------------------------------------------------------- fields


def shipped_kubernetes(tmp_path: Path) -> list[tuple[str, dict]]:
    """Every workload of every overlay, and of cpu and gpu with every component."""
    directories = [KUSTOMIZE_ROOT / "overlays" / o for o in ("cpu", "gpu", "remote-site")]
    components = tuple(sorted(p.name for p in (KUSTOMIZE_ROOT / "components").iterdir()))
    directories += [user_overlay(tmp_path / o, o, components) for o in ("cpu", "gpu")]
    return [(f"{d.name} {w['kind']}/{w['metadata']['name']}", w) for d in directories for w in workloads(render(d))]


def test_every_shipped_manifest_passes_the_field_check(tmp_path):
    checked = shipped_kubernetes(tmp_path)
    for name, workload in checked:
        check_workload(workload, name)
    assert {w["kind"] for _, w in checked} == set(WORKLOAD_KINDS)
    for overrides in [(), *((path,) for path in COMPOSE_OVERRIDES)]:
        compose = load_compose(VARIABLES, overrides)
        for name, spec in compose["services"].items():
            if "build" in spec:  # the services the harness runs: Flywheel's image
                check_compose_service(spec, f"compose service {name}")
        for name, spec in (compose.get("volumes") or {}).items():
            check_compose_volume(spec, f"compose volume {name}")


def test_each_field_is_either_played_or_a_no_op_with_its_reason():
    assert not IMPLEMENTED & set(NO_OPS)
    assert all(len(reason) > 20 for reason in NO_OPS.values()), NO_OPS


@pytest.mark.parametrize("where, field, value", [
    (("containers", 0, "securityContext"), "readOnlyRootFilesystem", True),
    ((), "hostNetwork", True),
    (("volumes", 0), "hostPath", {"path": "/srv/models"}),
    (("containers", 0, "env", 0), "optionalSecret", True),
])
def test_kubernetes_harness_refuses_a_field_it_does_not_play(tmp_path, where, field, value):
    objects = copy.deepcopy(render_overlay("cpu"))
    (trainer,) = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "flywheel-trainer"]
    target = trainer["spec"]["template"]["spec"]
    for key in where:
        target = target[key]
    target[field] = value
    with pytest.raises(AssertionError) as refused:
        Kube(None, objects, tmp_path)  # refused before anything runs
    path = "spec.template.spec" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in where) + f".{field}"
    assert f"StatefulSet/flywheel-trainer: field {path} " in str(refused.value), refused.value
    Kube(None, render_overlay("cpu"), tmp_path)  # the shipped overlay itself passes


def test_kubernetes_harness_refuses_a_selector_that_misses_its_template(tmp_path):
    objects = copy.deepcopy(render_overlay("cpu"))
    (rollout,) = [o for o in objects if o["kind"] == "Deployment"]
    rollout["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "trainer"
    with pytest.raises(AssertionError, match="Deployment/flywheel-rollout: spec.selector does not match"):
        Kube(None, objects, tmp_path)


@pytest.mark.parametrize("section, field, value", [
    ("services.trainer", "read_only", True),
    ("services.trainer", "cap_add", ["SYS_ADMIN"]),
    ("services.trainer.healthcheck", "disable", True),
    ("volumes.models", "external", True),
])
def test_compose_harness_refuses_a_field_it_does_not_play(tmp_path, section, field, value):
    compose = copy.deepcopy(load_compose(VARIABLES))
    target = compose
    for key in section.split("."):
        if target.get(key) is None:  # `models:` declares a volume with no settings
            target[key] = {}
        target = target[key]
    target[field] = value
    with pytest.raises(AssertionError) as refused:
        ComposeProject(NoNetwork(), tmp_path, VARIABLES, compose=compose)
    kind, name, *inner = section.split(".")
    owner = f"compose {'service' if kind == 'services' else 'volume'} {name}"
    assert f"{owner}: field {'.'.join([*inner, field])} " in str(refused.value), refused.value


# ---------------------------------------------------------------- the image's user and the volumes


def test_the_runtime_stages_run_as_10001_and_own_its_volume_paths():
    """The images' own directories under the volumes compose mounts: the user must write there."""
    for stage in ("cpu", "gpu"):
        assert image_user(stage) == Identity(10001, 10001), stage
        directories = image_directories(stage)
        for path in ("/data", "/models", "/home/flywheel"):
            assert (directories[path].uid, directories[path].gid) == (10001, 10001), (stage, path, directories)


def test_compose_volumes_start_as_docker_makes_them(tmp_path):
    project = ComposeProject(NoNetwork(), tmp_path, VARIABLES, scale={"rollout": 2})
    assert {c.name: c.user for cs in project.containers.values() for c in cs} == {
        c.name: USER for cs in project.containers.values() for c in cs}
    # From the image's /models and /data (its user's); weights-shm's tmpfs options.
    assert owner_and_mode(project.volumes["models"]) == (10001, 10001, 0o755)
    assert owner_and_mode(project.volumes["flywheel-data"]) == (10001, 10001, 0o755)
    assert owner_and_mode(project.volumes["weights-shm"]) == (10001, 10001, 0o700)
    (trainer,) = project.containers["trainer"]
    assert trainer.env["HOME"] == "/home/flywheel"
    assert owner_and_mode(trainer.mounts["/home/flywheel"][0]) == (10001, 10001, 0o755)
    # A bind mount keeps the host's ownership.
    assert trainer.mounts["/etc/flywheel/examples"] == (ROOT / "examples", True)


def test_compose_user_overrides_the_image_user(tmp_path):
    compose = copy.deepcopy(load_compose(VARIABLES))
    compose["services"]["trainer"]["user"] = "4242"
    compose["services"]["synchronizer"]["user"] = "10001:4343"
    project = ComposeProject(NoNetwork(), tmp_path, VARIABLES, compose=compose)
    assert project.containers["trainer"][0].user == Identity(4242, 0)
    assert project.containers["trainer"][0].env["HOME"] == "/"  # no passwd entry in the image
    assert project.containers["synchronizer"][0].user == Identity(10001, 4343)


def kube_pod(tmp_path: Path, workload: str, fs_group: bool = True) -> tuple[Kube, Pod]:
    objects = copy.deepcopy(render_overlay("cpu"))
    objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "flywheel-tokens", "namespace": "flywheel"},
                    "data": {"tokens.yaml": "c2VydmljZTogc2VjcmV0Cg=="}})  # "service: secret\n"
    kube = Kube(None, objects, tmp_path)
    (owner,) = [o for o in objects if o["kind"] in WORKLOAD_KINDS and o["metadata"]["name"] == workload]
    spec = owner["spec"]["template"]["spec"]
    if not fs_group:
        del spec["securityContext"]["fsGroup"]
    home = tmp_path / "pods" / workload
    home.mkdir(parents=True)
    return kube, Pod(workload, owner, spec, {}, {}, Host(workload, "none", "127.0.0.1", workload), home)


def test_kubelet_volumes_with_fs_group(tmp_path):
    kube, pod = kube_pod(tmp_path, "flywheel-trainer")
    volumes = kube._volumes(pod)
    setgid = stat.S_ISGID
    assert owner_and_mode(volumes["models"][0]) == (0, 10001, 0o777 | setgid)  # emptyDir
    assert owner_and_mode(volumes["data"][0]) == (0, 10001, 0o775 | setgid)  # a new claim, 0755 + group rwx
    assert owner_and_mode(volumes["tokens"][0] / "tokens.yaml") == (0, 10001, 0o440)  # secret, defaultMode 0440
    (trainer,) = pod.spec["containers"]
    assert kube.identity(pod, trainer) == Identity(10001, 10001, (10001,), no_new_privs=True, drop_capabilities=True)


def test_kubelet_volumes_without_fs_group(tmp_path):
    kube, pod = kube_pod(tmp_path, "flywheel-trainer", fs_group=False)
    volumes = kube._volumes(pod)
    assert owner_and_mode(volumes["models"][0]) == (0, 0, 0o777)
    assert owner_and_mode(volumes["data"][0]) == (0, 0, 0o755)
    assert owner_and_mode(volumes["tokens"][0] / "tokens.yaml") == (0, 0, 0o440)


def test_kubelet_refuses_run_as_non_root_with_root(tmp_path):
    kube, pod = kube_pod(tmp_path, "flywheel-synchronizer")
    (container,) = pod.spec["containers"]
    container["securityContext"]["runAsUser"] = 0
    with pytest.raises(AssertionError, match="runAsNonRoot and image will run as root"):
        kube.identity(pod, container)
    del pod.spec["securityContext"]["runAsUser"], container["securityContext"]["runAsUser"]
    assert kube.identity(pod, container).uid == USER.uid  # the image's USER


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
def test_a_container_process_is_the_user_it_is_given(tmp_path):
    """setpriv as the harness runs it: ids, groups, no_new_privs, no capabilities; the interpreter is
    reachable by that user; it writes where the volume's owner lets it and nowhere else."""
    mine = tmp_path / "mine"
    root_owned = tmp_path / "root-owned"
    for path, uid in ((mine, 10001), (root_owned, 0)):
        path.mkdir()
        os.chown(path, uid, uid)
    script = ("import time; open('/mine/ok', 'w').write('1')\n"
              "try:\n    open('/root-owned/no', 'w')\nexcept PermissionError:\n    print('refused', flush=True)\n"
              "time.sleep(120)")  # stays up until the test has looked at it (then SIGTERM)
    with NamespaceCluster(tmp_path) as cluster:
        host = cluster.add_host("probe", names=[])
        user = Identity(10001, 10001, (10001, 4242), no_new_privs=True, drop_capabilities=True)
        proc = cluster.run(host, [sys.executable, "-c", script], env={"PATH": os.environ["PATH"]},
                           mounts={"/mine": (mine, False), "/root-owned": (root_owned, False)}, cwd=Path("/mine"),
                           log=tmp_path / "log", user=user)
        deadline = time.monotonic() + 30
        while "refused" not in (tmp_path / "log").read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        done = cluster.exec(proc, ["sh", "-c", "id -u; pwd"], env={"PATH": os.environ["PATH"]}, timeout=10, user=user)
        ids, privileges = process_identity(proc.pid), process_privileges(proc.pid)
        cluster.stop(grace=5)
    assert done.stdout.split() == ["10001", "/mine"], done  # exec: the container's user, in its working directory
    assert ids == {"uid": 10001, "gid": 10001, "groups": (4242, 10001)}
    assert privileges == {"no_new_privs": True, "bounding_set": 0}
    assert "refused" in (tmp_path / "log").read_text(), (tmp_path / "log").read_text()
    assert owner_and_mode(mine / "ok")[:2] == (10001, 10001)
    assert not (root_owned / "no").exists()
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(host.netns) == 0
