"""Every port, env var, command and probe in docker-compose.yml and the rendered
Kubernetes overlays matches what the services accept.

Nothing here is a hand-kept list: each container's `FLYWHEEL_*` variables are
resolved through its service's own config model (the same code path
`python -m services.<name>` uses), and the ports, probes, healthchecks and
scrape targets are compared with the resolved config.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml

from flywheel.runtime.config import env_name, leaf_fields, resolve
from tests.deploy.manifests import (
    COMPOSE_ENV_EXAMPLE,
    OVERLAYS,
    ROOT,
    SERVICES,
    SHARED_ENV,
    Container,
    config_class,
    image_files,
    read_env_file,
)

HEALTHCHECK_SCRIPT = "/opt/flywheel/healthcheck.py"
# Model loading may take this long before SERVING; startup probes must allow it.
MODEL_LOAD_SECONDS = 600


def resolved(container: Container):
    """The config the container's service ends up with, from the container's env alone."""
    return resolve(config_class(container.service), env=container.env, env_prefix=container.prefix)


def known_env(service: str) -> set[str]:
    from flywheel.runtime.entry import env_prefix

    known = {env_name(env_prefix(service), path) for path in leaf_fields(config_class(service))} | set(SHARED_ENV)
    if service == "controller":
        from services.controller.local_run import RUNS_DIR_ENV

        known.add(RUNS_DIR_ENV)  # read by `run` (the launcher), not by the server's config
    return known


def written_dirs(container: Container) -> dict[str, str]:
    """The directories a service writes (config fields named `dir` or `*_dir`), as the container
    sets them; unset or empty ones (e.g. shared_memory_dir: "", off) are written by nobody."""
    config, found = resolved(container), {}
    for path in leaf_fields(type(config)):
        if path[-1] == "dir" or path[-1].endswith("_dir"):
            value = config
            for part in path:
                value = getattr(value, part)
            if value not in (None, ""):
                found[".".join(path)] = str(value)
    return found


def expected_ports(container: Container) -> dict[str, int]:
    config = resolved(container)
    ports = {"grpc": config.server.port, "metrics": config.server.metrics_port}
    if hasattr(config, "http_port"):
        ports["http"] = config.http_port
    if hasattr(config, "status_port"):
        ports["http"] = config.status_port
    return ports


def test_services_are_found():
    assert set(SERVICES) == {"synchronizer", "trainer", "rollout", "controller"}


# ---------------------------------------------------------------- both kinds of manifest


@pytest.fixture(params=["kubernetes", "compose"])
def containers(request, composed) -> list[Container]:
    if request.param == "compose":
        return composed
    return request.getfixturevalue("k8s")


def test_every_service_is_deployed(containers):
    assert {c.service for c in containers} == set(SERVICES)


def test_commands_run_the_service_they_are_named_after(containers):
    for c in containers:
        assert c.command == ["python", "-m", f"services.{c.service}"], c.source
        assert c.name.split("-")[0] == c.service, f"{c.source}: named {c.name} but runs {c.service}"


def test_every_flywheel_variable_is_a_config_field_of_its_service(containers):
    for c in containers:
        # Kubernetes variables from valueFrom count too; envFrom could hide any name, so it is not used.
        names = set(c.env) | {e["name"] for e in c.raw.get("env", []) if isinstance(e, dict)}
        assert "envFrom" not in c.raw, f"{c.source}: list variables one by one so they can be checked"
        if c.service == "controller":  # run-file overrides: each must name a run config field
            from services.controller.local_run import RUN_ENV_PREFIX, run_env_overrides

            run_env_overrides({k: v for k, v in c.env.items() if k.startswith(RUN_ENV_PREFIX)})
            names = {k for k in names if not k.startswith(RUN_ENV_PREFIX)}
        unknown = {k for k in names if k.startswith("FLYWHEEL_")} - known_env(c.service)
        assert not unknown, f"{c.source}: {sorted(unknown)} configure nothing in services.{c.service}"


def test_every_value_validates_and_services_listen_on_all_interfaces(containers):
    for c in containers:
        config = resolved(c)  # raises ConfigError naming the field and variable
        assert config.server.host == "0.0.0.0", f"{c.source}: a container must listen on 0.0.0.0"


def test_the_auth_token_is_configured(containers):
    for c in containers:
        assert set(SHARED_ENV) & set(c.env), f"{c.source}: no auth token configured"


def test_controller_arguments_name_a_mounted_run_config(k8s, composed):
    for c in [*k8s, *composed]:
        if c.service != "controller":
            continue
        assert c.args[:1] == ["run"] and len(c.args) == 2, f"{c.source}: expected `run CONFIG`, got {c.args}"
        mounts = _k8s_mounts(c) if c.pod else _compose_mounts(c)
        assert any(PurePosixPath(c.args[1]).is_relative_to(m) for m in [*mounts, *image_files()]), (
            f"{c.source}: {c.args[1]} is neither mounted nor in the image"
        )


def _run_file(c: Container, k8s_objects: list[dict] | None) -> dict[str, Any]:
    """The run file a controller container runs (`run FILE`), read where the container finds it."""
    path = PurePosixPath(c.args[1])
    if c.pod and path.parent in _k8s_mounts(c):
        volume = _k8s_mounts(c)[path.parent]["volume"]
        configmaps = {o["metadata"]["name"]: o for o in k8s_objects or [] if o["kind"] == "ConfigMap"}
        return yaml.safe_load(configmaps[volume["configMap"]["name"]]["data"][path.name])
    # The image's copy, or compose's bind mount of the same repository directory.
    (image_dir,) = [d for d in image_files() if path.is_relative_to(d)]
    return yaml.safe_load((image_files()[image_dir] / path.relative_to(image_dir)).read_text())


def _run_config(c: Container, k8s_objects: list[dict] | None) -> Any:
    """The run config the controller's `run` ends up with (file, then FLYWHEEL_RUN__* variables),
    parsed by the controller's own code."""
    from services.controller.launcher.spec import split_run_file
    from flywheel.runtime.config import deep_merge
    from services.controller.local_run import run_env_overrides
    from services.controller.run_config import parse_run_config

    _, data = split_run_file(_run_file(c, k8s_objects), c.source)
    deep_merge(data, run_env_overrides(c.env))
    assert "services" in data, f"{c.source}: the run names no services; the launcher would start its own"
    data.setdefault("model", {}).setdefault("name", "served")
    for split in ("train", "validation"):  # the launcher generates these files at run time
        section = data.get("data", {}).get(split)
        if section is not None and not {"path", "items", "hf_name"} & set(section):
            section["items"] = [{"question": "1 + 1", "answer": "2"}]
    return parse_run_config(data, c.source)


def _grpc_port_of(containers: list[Container], service: str) -> set[int]:
    return {expected_ports(c)["grpc"] for c in containers if c.service == service}


def _compose_names(compose: dict[str, Any]) -> dict[str, set[str]]:
    """DNS name -> the compose services answering to it (their names and network aliases)."""
    names: dict[str, set[str]] = {}
    for name, spec in compose["services"].items():
        for alias in [name, *((spec.get("networks") or {}).get("default") or {}).get("aliases", [])]:
            names.setdefault(alias, set()).add(name)
    return names


def test_compose_controller_runs_against_the_compose_services(composed, compose):
    names = _compose_names(compose)
    for controller in [c for c in composed if c.service == "controller"]:
        services = _run_config(controller, None).services
        for role, endpoint in [("synchronizer", services.synchronizer), ("trainer", services.trainer),
                               *(("rollout", r) for r in services.rollout)]:
            host, port = endpoint.address.rsplit(":", 1)
            assert host in names, f"{controller.source}: {role} address {endpoint.address} names no compose service"
            ports = {expected_ports(c)["grpc"] for c in composed if c.name in names[host] and c.service == role}
            assert ports == {int(port)}, f"{controller.source}: {role} at {endpoint.address}, listening on {ports}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_controller_runs_against_the_cluster_services(rendered, k8s, overlay):
    objects = rendered[overlay]
    (controller,) = [c for c in k8s if c.service == "controller" and c.source.startswith(f"kubernetes/{overlay} ")]
    services = _run_config(controller, objects).services
    k8s_services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for role, endpoint in [("synchronizer", services.synchronizer), ("trainer", services.trainer),
                           *(("rollout", r) for r in services.rollout)]:
        host, port = endpoint.address.rsplit(":", 1)
        # "<pod>.<headless service>" (a StatefulSet member) or "<service>".
        svc_name = host.split(".")[1] if "." in host else host
        assert svc_name in k8s_services, f"{overlay}: {role} address {endpoint.address} names no Service"
        svc = k8s_services[svc_name]
        workload = [w for w in _workloads(objects)
                    if _selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])][0]
        if "." in host:
            assert workload["kind"] == "StatefulSet" and host.split(".")[0].rsplit("-", 1)[0] == workload["metadata"]["name"]
        served = [c for c in k8s if c.source == f"kubernetes/{overlay} {workload['kind']}/{workload['metadata']['name']}"]
        assert [c.service for c in served] == [role], f"{overlay}: {endpoint.address} reaches {served}"
        assert {p["port"] for p in svc["spec"]["ports"]} >= {int(port)} == {expected_ports(served[0])["grpc"]}, (
            f"{overlay}: {role} at {endpoint.address}"
        )


def test_controller_cli_accepts_run_when_it_exists():
    help_text = subprocess.run(
        [sys.executable, "-m", "services.controller", "--help"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    ).stdout
    if not re.search(r"\brun\b", help_text.split("options:")[0]):
        pytest.skip("services.controller has no `run` subcommand yet (it arrives with the quickstart issue)")
    done = subprocess.run(
        [sys.executable, "-m", "services.controller", "run", "--help"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- Kubernetes


def _k8s_mounts(c: Container) -> dict[PurePosixPath, dict]:
    """mount path -> {volume, readOnly}"""
    volumes = {v["name"]: v for v in c.pod["spec"].get("volumes", [])}
    return {
        PurePosixPath(m["mountPath"]): {"volume": volumes[m["name"]], "readOnly": m.get("readOnly", False)}
        for m in c.raw.get("volumeMounts", [])
    }


def _under_writable_mount(path: str, mounts: dict[PurePosixPath, dict]) -> bool:
    return any(PurePosixPath(path).is_relative_to(p) and not m["readOnly"] for p, m in mounts.items())


def test_container_ports_are_the_configured_ports(k8s):
    for c in k8s:
        declared = {p["name"]: p["containerPort"] for p in c.raw["ports"]}
        assert declared == expected_ports(c), c.source


def test_probes_ask_grpc_health_on_the_configured_port(k8s):
    for c in k8s:
        port = resolved(c).server.port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c.raw[probe]["grpc"]["port"] == port, f"{c.source}: {probe}"
            assert "service" not in c.raw[probe]["grpc"], "the overall health status is the one set to SERVING"
        startup = c.raw["startupProbe"]
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        if c.service in ("trainer", "rollout"):
            assert budget >= MODEL_LOAD_SECONDS, f"{c.source}: startupProbe allows only {budget}s for model loading"
        if c.service == "controller":  # it serves after waiting for the services (launch.ready_timeout_seconds)
            from services.controller.launcher.spec import split_run_file

            wait = split_run_file(_run_file(c, None), c.source)[0].ready_timeout_seconds
            assert budget >= wait + 60, f"{c.source}: startupProbe allows {budget}s, the run waits {wait}s"


def test_prometheus_annotations_point_at_the_metrics_port(k8s):
    for c in k8s:
        annotations = c.pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == resolved(c).server.metrics_port, c.source


def test_termination_grace_outlasts_the_shutdown_grace(k8s):
    for c in k8s:
        grace = c.pod["spec"].get("terminationGracePeriodSeconds", 30)
        assert grace > resolved(c).server.shutdown_grace_seconds, c.source


def test_token_file_is_the_mounted_secret(k8s):
    for c in k8s:
        path = PurePosixPath(c.env["FLYWHEEL_AUTH_TOKEN_FILE"])
        mount = _k8s_mounts(c)[path.parent]
        secret = mount["volume"]["secret"]
        assert secret["secretName"] == "flywheel-auth" and not secret.get("optional", False), c.source
        assert {"key": "token", "path": path.name} in secret["items"], c.source


def test_directories_the_services_write_are_on_writable_volumes(k8s):
    for c in k8s:
        for name, path in written_dirs(c).items():
            assert _under_writable_mount(path, _k8s_mounts(c)), f"{c.source}: {name}={path} is not on a writable volume"


def test_trainer_and_rollout_get_a_memory_backed_dev_shm(k8s):
    for c in k8s:
        if c.service in ("trainer", "rollout"):
            volume = _k8s_mounts(c)[PurePosixPath("/dev/shm")]["volume"]
            assert volume["emptyDir"]["medium"] == "Memory", c.source


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_are_requested_only_by_the_gpu_overlay(rendered, k8s, overlay):
    for c in k8s:
        if not c.source.startswith(f"kubernetes/{overlay} "):
            continue
        gpus = c.raw["resources"].get("limits", {}).get("nvidia.com/gpu")
        wanted = 1 if overlay == "gpu" and c.service in ("trainer", "rollout") else None
        assert gpus == wanted, c.source
        assert c.raw["image"] == pinned_image(overlay), c.source
        for init in c.pod["spec"].get("initContainers", []):
            assert init["image"] == pinned_image(overlay), f"{c.source} {init['name']}"
        assert c.raw["resources"]["requests"] and c.raw["resources"]["limits"]["memory"], c.source


def pinned_image(target: str) -> str:
    """Deployments run the image of this package version, never a moving tag."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return f"flywheel:{version}-{target}"


def test_compose_images_are_pinned_to_the_package_version(compose):
    for name, svc in compose["services"].items():
        if "build" in svc:
            assert svc["image"] == pinned_image(svc["build"]["target"]), name
        else:  # third-party images: an exact release
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", svc["image"]), name


def _workloads(objects):
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_route_to_the_right_ports(rendered, overlay):
    objects = rendered[overlay]
    for svc in (o for o in objects if o["kind"] == "Service"):
        pods = [
            w
            for w in _workloads(objects)
            if _selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(pods) == 1, f"Service {svc['metadata']['name']} selects {len(pods)} workloads"
        container = pods[0]["spec"]["template"]["spec"]["containers"][0]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, f"{svc['metadata']['name']}: no container port {port['targetPort']}"
            assert port["port"] == named[port["targetPort"]], f"{svc['metadata']['name']}: {port['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_statefulsets_have_headless_services_published_before_ready(rendered, overlay):
    objects = rendered[overlay]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    sets = [o for o in objects if o["kind"] == "StatefulSet"]
    assert {s["spec"]["template"]["spec"]["containers"][0]["name"] for s in sets} == {"synchronizer", "trainer"}
    for sts in sets:
        svc = services[sts["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollouts_scale_under_a_disruption_budget(rendered, overlay):
    objects = rendered[overlay]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["name"] == "rollout"
    (pdb,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert _selects(pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_controller_trainer_and_rollout_take_the_same_run_file(rendered, k8s, overlay):
    """The Job runs the file whose launch.<service> sections trainer and rollouts start from."""
    deployed = [c for c in k8s if c.source.startswith(f"kubernetes/{overlay} ")]
    (controller,) = [c for c in deployed if c.service == "controller"]
    run_file = controller.args[1]
    for c in deployed:
        if c.service in ("trainer", "rollout"):
            assert c.args == ["--run-file", run_file], c.source
    assert _run_config(controller, rendered[overlay]).run.max_steps >= 1


# ---------------------------------------------------------------- compose


def _compose_mounts(c: Container) -> dict[PurePosixPath, dict]:
    mounts = {}
    for volume in c.raw.get("volumes", []):
        parts = volume.split(":")
        mounts[PurePosixPath(parts[1])] = {"source": parts[0], "readOnly": parts[2:] == ["ro"]}
    return mounts


def _published(c: Container) -> set[int]:
    return {int(p.rsplit(":", 1)[1]) for p in c.raw.get("ports", [])}


def test_compose_publishes_the_configured_ports(composed):
    for c in composed:
        ports = expected_ports(c)
        assert _published(c) == {ports["grpc"], *([ports["http"]] if "http" in ports else [])}, c.source


def test_compose_healthcheck_asks_the_configured_port(composed):
    for c in composed:
        port = resolved(c).server.port
        assert c.raw["healthcheck"]["test"] == ["CMD", "python", HEALTHCHECK_SCRIPT, f"127.0.0.1:{port}"], c.source


def test_compose_services_wait_for_a_healthy_synchronizer(composed):
    for c in composed:
        if c.service != "synchronizer":
            assert c.raw["depends_on"]["synchronizer"]["condition"] == "service_healthy", c.source


def test_compose_directories_the_services_write_are_on_volumes(composed):
    for c in composed:
        for name, path in written_dirs(c).items():
            assert _under_writable_mount(path, _compose_mounts(c)), f"{c.source}: {name}={path} is not on a volume"


def _default_profiles() -> set[str]:
    """The profiles plain `docker compose up` activates: COMPOSE_PROFILES from the project's .env."""
    dotenv = ROOT / ".env"
    value = read_env_file(dotenv).get("COMPOSE_PROFILES", "") if dotenv.exists() else ""
    assert value, "`docker compose up` starts no trainer or rollout: put COMPOSE_PROFILES=cpu in the repository's .env"
    return {p for p in value.split(",") if p}


@pytest.mark.parametrize("profiles", [None, {"gpu"}])
def test_each_profile_runs_every_service_once(compose, composed, profiles):
    """`docker compose up` (profiles from .env) and COMPOSE_PROFILES=gpu each start one of every service."""
    active = _default_profiles() if profiles is None else profiles
    started = [c for c in composed if not c.raw.get("profiles") or set(c.raw["profiles"]) & active]
    assert sorted(c.service for c in started) == sorted(SERVICES), (
        f"profiles {active or '{}'} start {[c.name for c in started]}"
    )
    for c in started:  # the others reach every service by its plain name
        aliases = c.raw.get("networks", {}).get("default", {}).get("aliases", [])
        assert c.service == c.name or c.service in aliases, c.source


def test_prometheus_scrapes_every_service_on_its_metrics_port(composed):
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = set()
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            targets |= {(name, sd["port"]) for name in sd["names"]}
        for static in job.get("static_configs", []):
            targets |= {(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in static["targets"]}
    wanted = {(c.service, resolved(c).server.metrics_port) for c in composed}
    assert targets == wanted


def test_compose_env_file_example_sets_only_known_variables():
    env = read_env_file(COMPOSE_ENV_EXAMPLE)
    assert env and set(env) <= set(SHARED_ENV) | set().union(*(known_env(s) for s in SERVICES))


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_exposes_the_default_ports_and_ships_the_healthcheck():
    dockerfile = (ROOT / "Dockerfile").read_text()
    defaults = set()
    for service in SERVICES:
        config = config_class(service)()
        defaults |= {config.server.port, config.server.metrics_port}
        defaults |= {getattr(config, name) for name in ("http_port", "status_port") if hasattr(config, name)}
    for line in re.findall(r"^EXPOSE (.+)$", dockerfile, re.MULTILINE):
        assert {int(p) for p in line.split()} == defaults
    assert dockerfile.count(f"COPY deploy/docker/healthcheck.py {HEALTHCHECK_SCRIPT}") == 2
    assert dockerfile.count(f'CMD ["python", "{HEALTHCHECK_SCRIPT}"]') == 2
    for target in ("cpu", "gpu"):
        assert re.search(rf"^FROM \S+ AS {target}$", dockerfile, re.MULTILINE), target
        assert "USER 10001:10001" in dockerfile.split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]


def test_dockerignore_admits_everything_the_dockerfile_copies():
    allowed = {
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", (ROOT / "Dockerfile").read_text(), re.MULTILINE):
        for path in source.split():
            assert path.rstrip("*") in allowed, f"COPY {path} is excluded by .dockerignore"
            assert (ROOT / path.rstrip("*")).exists() or path.endswith("*"), f"COPY {path}: no such file"


def test_compose_rollouts_mount_the_synchronizers_shared_memory(compose, composed):
    [sync] = [c for c in composed if c.service == "synchronizer"]
    directory = PurePosixPath(resolved(sync).shared_memory_dir)
    volume = _compose_mounts(sync)[directory]["source"]
    assert compose["volumes"][volume]["driver_opts"]["type"] == "tmpfs"  # memory, not disk
    for c in composed:
        if c.service == "rollout":  # the same path: the stream names files by it
            assert _compose_mounts(c)[directory]["source"] == volume, c.source


# ---------------------------------------------------------------- weights by NCCL on GPU deployments

DEPLOYMENTS = [("compose", "cpu"), ("compose", "gpu"), ("kubernetes", "cpu"), ("kubernetes", "gpu")]


def _deployment(kind: str, variant: str, composed, k8s, rendered, compose) -> dict[str, Container]:
    """service -> the one container of that deployment running it."""
    if kind == "compose":
        active = _default_profiles() if variant == "cpu" else {variant}
        chosen = [c for c in composed if not c.raw.get("profiles") or set(c.raw["profiles"]) & active]
    else:
        chosen = [c for c in k8s if c.source.startswith(f"kubernetes/{variant} ")]
    return {c.service: c for c in chosen}


@pytest.mark.parametrize(("kind", "variant"), DEPLOYMENTS, ids=[f"{k}-{v}" for k, v in DEPLOYMENTS])
def test_gpu_deployments_move_weights_by_nccl_rendezvousing_at_the_trainers_dns_name(
    kind, variant, composed, k8s, rendered, compose
):
    """What the synchronizer does with the rendered config: the controller's run sets the sync
    method; `group_backend: auto` picks nccl when every member registered a CUDA device (the trainer
    its model.device, a rollout "cuda" when its engine is vLLM); the group's rendezvous is the
    trainer's advertised host (rendezvous_host empty), which must reach the trainer's pod or container."""
    deployed = _deployment(kind, variant, composed, k8s, rendered, compose)
    run = _run_config(deployed["controller"], rendered.get(variant) if kind == "kubernetes" else None)
    trainer, rollout, synchronizer = (resolved(deployed[s]) for s in ("trainer", "rollout", "synchronizer"))
    if variant == "cpu":
        assert run.sync.method == "memory", f"{kind}/{variant}: CPU deployments move weights through the synchronizer"
        return
    assert run.sync.method == "nccl", f"{kind}/{variant}: the run's sync.method is {run.sync.method}"
    assert trainer.model.device.startswith("cuda"), f"{kind}/{variant}: trainer on {trainer.model.device}"
    assert rollout.engine.kind == "vllm", f"{kind}/{variant}: rollout engine {rollout.engine.kind} registers a CPU"
    assert synchronizer.group_backend in ("auto", "nccl"), synchronizer.group_backend
    assert synchronizer.rendezvous_host == "", "a fixed rendezvous host would bypass the trainer's DNS name"
    host = trainer.sync.advertise_address.rsplit(":", 1)[0]
    if kind == "compose":
        answering = _compose_names(compose).get(host, set())
        assert deployed["trainer"].name in answering, f"compose/gpu: rendezvous host {host!r} is not the trainer"
    else:
        objects = rendered[variant]
        pod, _, service_name = host.partition(".")
        (svc,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == service_name]
        (sts,) = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == pod.rsplit("-", 1)[0]]
        assert svc["spec"].get("clusterIP") == "None", f"{service_name} must be headless: {host} names a pod"
        assert sts["spec"]["serviceName"] == service_name and pod.rsplit("-", 1)[1] == "0"
        assert _selects(svc["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
        assert [c.service for c in k8s if c.source == f"kubernetes/{variant} StatefulSet/{sts['metadata']['name']}"] == ["trainer"]
        # The rendezvous resolves while the group forms, before the trainer reports ready.
        assert svc["spec"].get("publishNotReadyAddresses") is True


def _address_fields(config: Any) -> list[tuple[str, str]]:
    """(field path, "host:port") of every configured *address field of a service config."""
    found = []
    for path in leaf_fields(type(config)):
        if not path[-1].endswith("address"):
            continue
        value: Any = config
        for part in path:
            value = getattr(value, part)
        if value:
            found.append((".".join(path), value))
    return found


@pytest.mark.parametrize(("kind", "variant"), DEPLOYMENTS, ids=[f"{k}-{v}" for k, v in DEPLOYMENTS])
def test_every_address_a_service_is_given_reaches_the_right_service_and_port(
    kind, variant, composed, k8s, rendered, compose
):
    """synchronizer addresses name the synchronizer's gRPC port; advertise addresses the container itself."""
    deployed = _deployment(kind, variant, composed, k8s, rendered, compose)
    for c in deployed.values():
        for path, address in _address_fields(resolved(c)):
            host, _, port = address.rpartition(":")
            role = c.service if "advertise" in path else "synchronizer" if "synchronizer" in path else c.service
            if kind == "compose":
                names = _compose_names(compose).get(host, set())
                targets = [t for t in deployed.values() if t.name in names]
            elif host == "$(POD_IP)":  # the downward API: the pod's own IP
                targets = [c]
            else:
                objects = rendered[variant]
                pod, _, service_name = host.rpartition(".")
                svcs = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == service_name]
                workloads = [w for w in _workloads(objects) for s in svcs
                             if _selects(s["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
                             and (not pod or (w["kind"] == "StatefulSet" and pod == f"{w['metadata']['name']}-0"))]
                sources = {f"kubernetes/{variant} {w['kind']}/{w['metadata']['name']}" for w in workloads}
                targets = [t for t in deployed.values() if t.source in sources]
            assert [t.service for t in targets] == [role], (
                f"{c.source}: {path} = {address} reaches {[t.source for t in targets]}, not the {role}")
            assert int(port) == expected_ports(targets[0])["grpc"], f"{c.source}: {path} = {address}"
