"""Every port, env var, command and probe in docker-compose.yml and the rendered
Kubernetes overlays matches what the services accept.

Nothing here is a hand-kept list: each container's `FLYWHEEL_*` variables are
resolved through its service's own config model (the same code path
`python -m services.<name>` uses), and the ports, probes, healthchecks and
scrape targets are compared with the resolved config.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

import pytest
import yaml

from flywheel.runtime.auth import TOKEN_ENV, TOKEN_FILE_ENV, TOKENS_FILE_ENV
from flywheel.runtime.config import env_name, leaf_fields
from tests.deploy.image import image_directories, image_user
from tests.deploy.volumes import ROOT_DIRECTORY, docker_tmpfs_options
from tests.deploy.manifests import (
    COMPOSE_ENV_EXAMPLE,
    OVERLAYS,
    OVERLAY_IMAGES,
    ROOT,
    SERVICES,
    SHARED_ENV,
    Container,
    compose_mounts,
    config_class,
    default_profiles,
    expected_ports,
    k8s_mounts,
    read_env_file,
    resolved,
    run_file,
    selects,
    workloads,
)

HEALTHCHECK_SCRIPT = "/opt/flywheel/healthcheck.py"
# Model loading may take this long before SERVING; startup probes must allow it.
MODEL_LOAD_SECONDS = 600


def known_env(service: str) -> set[str]:
    from flywheel.runtime.entry import env_prefix

    known = {env_name(env_prefix(service), path) for path in leaf_fields(config_class(service))} | set(SHARED_ENV)
    if service == "controller":
        from services.controller.launcher.local_run import RUNS_DIR_ENV

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


def test_services_are_found():
    assert set(SERVICES) == {"synchronizer", "trainer", "rollout", "controller", "tinker"}


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
            from services.controller.launcher.spec import RUN_ENV_PREFIX, run_env_overrides

            run_env_overrides({k: v for k, v in c.env.items() if k.startswith(RUN_ENV_PREFIX)})
            names = {k for k in names if not k.startswith(RUN_ENV_PREFIX)}
        unknown = {k for k in names if k.startswith("FLYWHEEL_")} - known_env(c.service)
        assert not unknown, f"{c.source}: {sorted(unknown)} configure nothing in services.{c.service}"


def test_every_value_validates_and_services_listen_on_all_interfaces(containers):
    for c in containers:
        config = resolved(c)  # raises ConfigError naming the field and variable
        assert config.server.host == "0.0.0.0", f"{c.source}: a container must listen on 0.0.0.0"


def test_scoped_tokens_are_configured_and_no_single_operator_token(containers):
    """Secure by default: every service reads the scoped tokens file (it accepts each token with
    its scope and calls the others with the service token); none is handed the single token of
    earlier releases, which means operator."""
    for c in containers:
        assert TOKENS_FILE_ENV in c.env, f"{c.source}: no tokens file configured"
        assert not {TOKEN_ENV, TOKEN_FILE_ENV} & set(c.env), f"{c.source}: a single (operator) token"


# ---------------------------------------------------------------- Kubernetes


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

            wait = split_run_file(run_file(c, None), c.source)[0].ready_timeout_seconds
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


def test_tokens_file_is_the_mounted_secret(k8s):
    for c in k8s:
        path = PurePosixPath(c.env[TOKENS_FILE_ENV])
        mount = k8s_mounts(c)[path.parent]
        secret = mount["volume"]["secret"]
        # Not optional: without the Secret a pod waits in ContainerCreating instead of running unauthenticated.
        assert secret["secretName"] == "flywheel-tokens" and not secret.get("optional", False), c.source
        assert {"key": "tokens.yaml", "path": path.name} in secret["items"] and mount["readOnly"], c.source


def test_directories_the_services_write_are_on_writable_volumes(k8s):
    for c in k8s:
        for name, path in written_dirs(c).items():
            assert _under_writable_mount(path, k8s_mounts(c)), f"{c.source}: {name}={path} is not on a writable volume"


def test_trainer_and_rollout_get_a_memory_backed_dev_shm(k8s):
    for c in k8s:
        if c.service in ("trainer", "rollout"):
            volume = k8s_mounts(c)[PurePosixPath("/dev/shm")]["volume"]
            assert volume["emptyDir"]["medium"] == "Memory", c.source


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_are_requested_only_by_the_gpu_overlay(rendered, k8s, overlay):
    for c in k8s:
        if not c.source.startswith(f"kubernetes/{overlay} "):
            continue
        gpus = c.raw["resources"].get("limits", {}).get("nvidia.com/gpu")
        wanted = 1 if overlay == "gpu" and c.service in ("trainer", "rollout") else None
        assert gpus == wanted, c.source
        assert c.raw["image"] == pinned_image(OVERLAY_IMAGES[overlay]), c.source
        for init in c.pod["spec"].get("initContainers", []):
            assert init["image"] == pinned_image(OVERLAY_IMAGES[overlay]), f"{c.source} {init['name']}"
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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_route_to_the_right_ports(rendered, overlay):
    objects = rendered[overlay]
    for svc in (o for o in objects if o["kind"] == "Service"):
        pods = [
            w
            for w in workloads(objects)
            if selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
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
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"
                     and o["spec"]["template"]["spec"]["containers"][0]["name"] == "rollout"]
    (pdb,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])


# ---------------------------------------------------------------- compose


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
            assert _under_writable_mount(path, compose_mounts(c)), f"{c.source}: {name}={path} is not on a volume"


#: What an RL job runs; the Tinker profile runs the gateway over a trainer and a rollout of its own.
RUN_SERVICES = ("synchronizer", "trainer", "rollout", "controller")
TINKER_SERVICES = ("synchronizer", "trainer", "rollout", "tinker")


@pytest.mark.parametrize("profiles, services", [(None, RUN_SERVICES), ({"gpu"}, RUN_SERVICES),
                                                ({"tinker"}, TINKER_SERVICES)])
def test_each_profile_runs_every_service_once(compose, composed, profiles, services):
    """`docker compose up` (profiles from .env) and COMPOSE_PROFILES=gpu each start one of every service of
    a run; COMPOSE_PROFILES=tinker one of every service the Tinker API needs; together, every service."""
    active = default_profiles() if profiles is None else profiles
    started = [c for c in composed if not c.raw.get("profiles") or set(c.raw["profiles"]) & active]
    assert sorted(c.service for c in started) == sorted(services), (
        f"profiles {active or '{}'} start {[c.name for c in started]}"
    )
    assert set(RUN_SERVICES) | set(TINKER_SERVICES) == set(SERVICES)
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
    assert set(env) <= set(SHARED_ENV) | set().union(*(known_env(s) for s in SERVICES))


def test_compose_services_read_the_tokens_tokens_init_writes_before_they_start(compose, composed):
    """tokens-init writes the tokens file into a volume every service mounts read-only at the path its
    FLYWHEEL_TOKENS_FILE names, and the synchronizer (which the others wait for) waits for it."""
    init = compose["services"]["tokens-init"]
    path = PurePosixPath(init["environment"][TOKENS_FILE_ENV])
    assert init["command"][-1] == str(path) and init["restart"] == "no"
    (written,) = [v for v in init["volumes"] if v.split(":")[1] == str(path.parent)]
    assert written.split(":")[2:] == [], "tokens-init writes the volume"
    for c in composed:
        assert c.env[TOKENS_FILE_ENV] == str(path), c.source
        assert compose_mounts(c)[path.parent] == {"source": written.split(":")[0], "readOnly": True}, c.source
    depends = compose["services"]["synchronizer"]["depends_on"]
    assert depends["tokens-init"]["condition"] == "service_completed_successfully"


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
    volume = compose_mounts(sync)[directory]["source"]
    assert compose["volumes"][volume]["driver_opts"]["type"] == "tmpfs"  # memory, not disk
    for c in composed:
        if c.service == "rollout":  # the same path: the stream names files by it
            assert compose_mounts(c)[directory]["source"] == volume, c.source


# ---------------------------------------------------------------- who may write the volumes


def test_compose_volumes_mounted_writable_belong_to_the_image_user(compose):
    """A new named volume starts as the image's directory at its mount path (root's, 0755, where the image
    has none) unless tmpfs options say otherwise: the user each Flywheel service runs as must own every
    named volume it mounts read-write. (The compose cluster test then runs them as that user.)"""
    for name, spec in compose["services"].items():
        if "build" not in spec:  # Prometheus and Grafana: other images
            continue
        stage = spec["build"]["target"]
        user = image_user(stage)
        assert "user" not in spec, f"compose/{name}: runs as another user than the image's"
        for entry in spec.get("volumes", []):
            source, path, *mode = entry.split(":")
            if source.startswith((".", "/")) or mode == ["ro"]:  # bind mounts keep the host's ownership
                continue
            options = ((compose["volumes"][source] or {}).get("driver_opts") or {}).get("o", "")
            owner = docker_tmpfs_options(options) or image_directories(stage).get(path) or ROOT_DIRECTORY
            assert (owner.uid, owner.gid) == (user.uid, user.gid), (
                f"compose/{name}: volume {source} at {path} starts as {owner}, but the service runs as {user}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_pods_may_write_their_claims_and_read_their_key_files(rendered, overlay):
    """A fresh claim is root's 0755 and configMap/secret files are root's: a non-root pod writes the one
    and reads the others only through fsGroup (or modes that let everyone)."""
    for workload in workloads(rendered[overlay]):
        pod = workload["spec"]["template"]["spec"]
        context = pod.get("securityContext") or {}
        assert context.get("runAsNonRoot"), workload["metadata"]["name"]
        mounts = [m for c in [*pod.get("initContainers", []), *pod["containers"]] for m in c.get("volumeMounts", [])]
        for volume in pod.get("volumes", []):
            written = any(m["name"] == volume["name"] and not m.get("readOnly") for m in mounts)
            if "persistentVolumeClaim" in volume and written:
                assert context.get("fsGroup") == context.get("runAsGroup"), (workload["metadata"]["name"], volume)
            files = volume.get("secret") or volume.get("configMap")
            if files is not None:
                for mode in [files.get("defaultMode", 0o644), *(i["mode"] for i in files.get("items", []) if "mode" in i)]:
                    assert mode & 0o004 or (mode & 0o040 and context.get("fsGroup") == context.get("runAsGroup")), (
                        workload["metadata"]["name"], volume["name"], oct(mode))


def _volume_at(c: Container, path: str) -> str | None:
    """Which volume holds `path` in `c`: a Kubernetes claim name, or a compose volume (or bind) source."""
    mounts = k8s_mounts(c) if c.source.startswith("kubernetes") else compose_mounts(c)
    for mount, spec in sorted(mounts.items(), key=lambda item: -len(item[0].parts)):
        if PurePosixPath(path).is_relative_to(mount):
            return spec["volume"].get("persistentVolumeClaim", {}).get("claimName") if "volume" in spec \
                else spec["source"]
    return None


def test_checkpoint_versions_are_read_where_the_trainer_publishes_them(containers):
    """sync.method: checkpoint works where it ships: the synchronizer (to verify a version) and each
    rollout (to load it) take the trainer's sync.publish_dir as checkpoint_root, on the same volume."""
    def deployment(c: Container) -> str:  # "kubernetes/cpu", "kubernetes/gpu" or "compose"
        return c.source.split(" ")[0] if c.source.startswith("kubernetes") else "compose"

    for source in {deployment(c) for c in containers}:
        group = [c for c in containers if deployment(c) == source]
        published = {str(resolved(c).sync.publish_dir) for c in group if c.service == "trainer"}
        volumes = {_volume_at(c, p) for c in group if c.service == "trainer" for p in published}
        assert len(published) == 1 and None not in volumes, (source, published, volumes)
        (directory,) = published
        for c in group:
            if c.service in ("synchronizer", "rollout"):
                config = resolved(c)
                root = config.checkpoint_root if c.service == "synchronizer" else config.updates.checkpoint_root
                assert str(root) == directory, f"{c.source}: checkpoint_root {root}, the trainer publishes to {directory}"
                assert _volume_at(c, directory) in volumes, f"{c.source}: {directory} is not on the trainer's volume"
