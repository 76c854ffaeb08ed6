"""TLS, mutual TLS and scoped tokens from Secrets, as deploy/README.md turns them on:
scoped tokens in every overlay as shipped, the Kubernetes components
(deploy/kubernetes/components/tls, tls-mutual) added to each overlay, and the compose override files (deploy/compose/
docker-compose.tls.yml, docker-compose.tls-mutual.yml) on top of docker-compose.yml.

Checked on the files as a user deploys them: overlays rendered with the components
and validated against the Kubernetes schemas, compose files validated against the
compose specification and merged as `docker compose -f ... -f ...` merges them;
every Flywheel container gets the Secret's files at the paths its variables name;
no probe is left that the kubelet would run in plaintext; the README's certificate
command names every address a service dials. tests/deploy/test_kubernetes_cluster.py
runs the services of a TLS overlay.
"""

from __future__ import annotations

import ipaddress
import json
import re
import stat
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from flywheel.runtime.tls import ENV as TLS_ENV
from tests.deploy.manifests import (
    OVERLAYS,
    ROOT,
    Container,
    compose_containers,
    find_tool,
    image_files,
    k8s_containers,
    k8s_mounts,
    load_compose,
    readme_cert_hosts,
    render,
    user_overlay,
)

COMPONENTS = ROOT / "deploy" / "kubernetes" / "components"
COMPOSE_TLS = ROOT / "deploy" / "compose" / "docker-compose.tls.yml"
COMPOSE_MUTUAL = ROOT / "deploy" / "compose" / "docker-compose.tls-mutual.yml"
#: What each Secret must hold (the keys deploy/README.md creates them with).
SECRET_KEYS = {"flywheel-tls": {"tls.crt", "tls.key", "ca.crt"}, "flywheel-tokens": {"tokens.yaml"}}
#: component set -> the variables every Flywheel container must get from a Secret; the scoped
#: tokens file without any component (the overlays as shipped), and with every one.
VARIANTS = {
    (): ("FLYWHEEL_TOKENS_FILE",),
    ("tls",): ("FLYWHEEL_TLS_CERT_FILE", "FLYWHEEL_TLS_KEY_FILE", "FLYWHEEL_TLS_CA_FILE", "FLYWHEEL_TOKENS_FILE"),
    ("tls", "tls-mutual"): (*TLS_ENV.values(), "FLYWHEEL_TOKENS_FILE"),
}
K8S_VERSIONS = ("1.29.0", "latest")  # as test_schemas.py


@pytest.fixture(scope="module")
def with_components(tmp_path_factory) -> dict[tuple[str, tuple[str, ...]], list[dict[str, Any]]]:
    """(overlay, components) -> the objects a user's overlay adding those components renders."""
    rendered = {}
    for overlay in OVERLAYS:
        for components in VARIANTS:
            directory = tmp_path_factory.mktemp(f"{overlay}-{'-'.join(components) or 'shipped'}")
            rendered[overlay, components] = render(user_overlay(directory, overlay, components) if components
                                                   else ROOT / "deploy" / "kubernetes" / "overlays" / overlay)
    return rendered


def _containers(objects: list[dict[str, Any]], overlay: str) -> list[Container]:
    found = k8s_containers(overlay, objects)
    runs = "tinker" if overlay == "tinker" else "controller"  # the Tinker overlay runs the gateway, no RL job
    assert {c.service for c in found} == {"synchronizer", "trainer", "rollout", runs}
    return found


# ---------------------------------------------------------------- Kubernetes


def test_components_render_and_match_the_kubernetes_schemas(with_components):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for (overlay, components), objects in with_components.items():
        for version in K8S_VERSIONS:
            for obj in objects:
                try:
                    kv.validate(obj, kv.latest_version() if version == "latest" else version, strict=True)
                except kv.ValidationError as exc:
                    pytest.fail(f"{overlay}+{components}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} "
                                f"at {list(exc.path)}")


@pytest.mark.parametrize("components", list(VARIANTS), ids=lambda components: "+".join(components) or "shipped")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_gets_the_secrets_files_at_the_paths_its_variables_name(
        with_components, overlay, components):
    for c in _containers(with_components[overlay, components], overlay):
        mounts = k8s_mounts(c)
        for variable in VARIANTS[components]:
            assert variable in c.env, f"{c.source}: {variable} is not set"
            path = PurePosixPath(c.env[variable])
            assert path.parent in mounts, f"{c.source}: {variable}={path} is not in a mounted volume"
            mount = mounts[path.parent]
            assert mount["readOnly"], f"{c.source}: {path.parent} is writable"
            secret = mount["volume"].get("secret")
            assert secret is not None, f"{c.source}: {variable}={path} is not from a Secret"
            items = {i["path"]: i["key"] for i in secret.get("items", [])} or {
                k: k for k in SECRET_KEYS[secret["secretName"]]}
            assert path.name in items, f"{c.source}: {variable}: Secret {secret['secretName']} has no {path.name}"
            assert items[path.name] in SECRET_KEYS[secret["secretName"]], items
            assert secret.get("optional") is not True, "a missing Secret must stop the pod, not turn TLS off"
        if "tls-mutual" in components:
            assert c.env["FLYWHEEL_TLS_CLIENT_CA_FILE"] == c.env["FLYWHEEL_TLS_CA_FILE"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_under_tls_no_probe_speaks_plaintext(with_components, rendered, overlay):
    """The kubelet's gRPC and HTTP probes are plaintext: under TLS every probe is the image's
    healthcheck script, which asks over TLS; thresholds and periods stay those of the overlay."""
    script = next(target for target in image_files() if target.endswith("healthcheck.py"))
    plain = {c.name: c.raw for c in k8s_containers(overlay, rendered[overlay])}
    for components in [v for v in VARIANTS if "tls" in v]:
        for c in _containers(with_components[overlay, components], overlay):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.raw[kind]
                assert set(probe) & {"grpc", "httpGet", "tcpSocket"} == set(), f"{c.source} {kind}: {probe}"
                assert probe["exec"]["command"] == ["python", script], f"{c.source} {kind}: {probe}"
                assert probe["timeoutSeconds"] >= 5, "the script's own deadline is 3 s, plus Python's start"
                kept = {k: v for k, v in plain[c.name][kind].items() if k not in ("grpc", "timeoutSeconds")}
                assert {k: probe[k] for k in kept} == kept, f"{c.source} {kind}"
            # Without an address the script asks the port of the container's one SERVER__PORT variable.
            ports = [k for k in c.env if re.fullmatch(r"FLYWHEEL_[A-Z]+__SERVER__PORT", k)]
            assert ports == [f"{c.prefix}SERVER__PORT"], f"{c.source}: {ports}"
            assert c.pod["metadata"]["annotations"].get("prometheus.io/scheme") == "https", c.source


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_healthcheck_script_finds_the_port_from_the_containers_variables(with_components, overlay):
    sys.path.insert(0, str(ROOT / "deploy" / "docker"))
    try:
        import healthcheck
    finally:
        sys.path.pop(0)
    for c in _containers(with_components[overlay, ("tls",)], overlay):
        port = next(p["containerPort"] for p in c.raw["ports"] if p["name"] == "grpc")
        assert healthcheck.default_address(c.env) == f"127.0.0.1:{port}", c.source


def advertised(c: Container, pod_ip: str, namespace: str, home: Path) -> tuple[str, list[str]]:
    """What the rollout container's command ends up running: the advertise address it exports
    and the arguments the service gets, from a `python` (written in `home`) that reports them."""
    fake = home / "python"
    fake.write_text('#!/bin/sh\necho "$FLYWHEEL_ROLLOUT__SYNCHRONIZER__ADVERTISE_ADDRESS"\nfor a in "$@"; do echo "$a"; '
                    'done\n')
    fake.chmod(0o755)
    env = {**c.env, "POD_IP": pod_ip, "POD_NAMESPACE": namespace, "PATH": f"{home}:/usr/bin:/bin"}
    done = subprocess.run([*c.command, *c.args], env=env, capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    address, *argv = done.stdout.splitlines()
    return address, argv


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollouts_advertise_their_pod_dns_name_under_tls(with_components, rendered, overlay, tmp_path):
    """A rollout pod's IP cannot be in a certificate made in advance: under TLS it registers
    as <IP with dashes>.<namespace>.pod, the pod's own DNS record, and runs the same service with
    the same arguments as without TLS."""
    (c,) = [c for c in _containers(with_components[overlay, ("tls",)], overlay) if c.service == "rollout"]
    (plain,) = [c for c in k8s_containers(overlay, rendered[overlay]) if c.service == "rollout"]
    address, argv = advertised(c, "10.244.3.17", "flywheel", tmp_path)
    assert address == f"10-244-3-17.flywheel.pod:{c.env['FLYWHEEL_ROLLOUT__SERVER__PORT']}"
    assert argv == ["-m", "services.rollout", *plain.args]


# ---------------------------------------------------------------- the certificate's names


def _matches(pattern: str, host: str) -> bool:
    """RFC 6125 as gRPC and OpenSSL apply it: exact, or `*` standing for the whole leftmost label
    of a name with at least two labels after it."""
    if pattern == host:
        return True
    if not pattern.startswith("*.") or pattern.count(".") < 2:
        return False
    label, _, rest = host.partition(".")
    return bool(label) and rest == pattern[2:]


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return host.strip("[]")


def dialled_in_kubernetes(containers: list[Container], objects: list[dict[str, Any]], scratch: Path) -> set[str]:
    """Every host a service or an agent dials: synchronizer and advertise addresses, the run's
    services, the rollouts' pod names, and each Service (short and namespaced). `scratch`: a
    directory for `advertised`'s reporting `python`."""
    hosts = set()
    (namespace,) = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    for c in containers:
        for name, value in c.env.items():
            if name.endswith(("SYNCHRONIZER_ADDRESS", "SYNCHRONIZER__ADDRESS", "ADVERTISE_ADDRESS")) and value \
                    and "$(" not in value:
                hosts.add(_host(value))
        if c.service == "controller":
            services = yaml.safe_load(c.env["FLYWHEEL_RUN__SERVICES"])
            hosts |= {_host(s["address"]) for s in services.values() if isinstance(s, dict) and "address" in s}
        if c.service == "rollout":
            hosts.add(_host(advertised(c, "10.1.2.3", namespace, scratch)[0]))
    for svc in (o for o in objects if o["kind"] == "Service"):
        name, namespace = svc["metadata"]["name"], svc["metadata"]["namespace"]
        hosts |= {name, f"{name}.{namespace}.svc"}
    return hosts


def test_the_readme_certificate_names_every_kubernetes_address(with_components, tmp_path):
    names = readme_cert_hosts("kubernetes")
    for (overlay, components), objects in with_components.items():
        if "tls" not in components:
            continue
        dialled = dialled_in_kubernetes(_containers(objects, overlay), objects, tmp_path)
        dialled.add("127.0.0.1")  # kubectl port-forward
        missing = {h for h in dialled if not any(_matches(n, h) for n in names)}
        assert not missing, f"{overlay}+{components}: the certificate does not name {sorted(missing)}"


def test_the_readme_certificate_names_every_compose_address():
    names = readme_cert_hosts("compose")
    compose = load_compose(overrides=(COMPOSE_TLS,))
    dialled = {"127.0.0.1"}  # the published ports
    for c in compose_containers(compose):
        dialled |= {_host(v) for k, v in c.env.items() if k.endswith(("ADDRESS",)) and v}
        dialled.add(c.raw.get("hostname") or c.name)
        if c.service == "controller":
            dialled |= {_host(s["address"]) for s in yaml.safe_load(c.env["FLYWHEEL_RUN__SERVICES"]).values()}
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus-tls.yml").read_text())
    dialled |= {job["tls_config"]["server_name"] for job in prometheus["scrape_configs"]}
    # The variants answer to the plain names (network aliases); nothing dials theirs.
    dialled -= {"trainer-gpu", "rollout-gpu", "controller-gpu", "trainer-tinker", "rollout-tinker"}
    missing = {h for h in dialled if not any(_matches(n, h) for n in names)}
    assert not missing, f"the certificate does not name {sorted(missing)}"


def test_wildcards_match_as_tls_libraries_match_them():
    assert _matches("*.flywheel.pod", "10-1-2-3.flywheel.pod")
    assert not _matches("*.flywheel.pod", "a.b.flywheel.pod")
    assert not _matches("*.pod", "x.pod")
    assert not _matches("synchronizer", "trainer")


def test_certificate_command_writes_the_secrets_keys(tmp_path):
    hosts = ["synchronizer", "*.flywheel.pod", "127.0.0.1"]
    done = subprocess.run([sys.executable, "-m", "flywheel.launcher.certs", str(tmp_path / "tls"), "--hosts", *hosts],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert stat.S_IMODE((tmp_path / "tls" / "tls.key").stat().st_mode) == 0o600
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((tmp_path / "tls" / "ca.crt").read_bytes())
    assert cert.issuer == ca.subject
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == hosts[:2]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]


# ---------------------------------------------------------------- compose


def _check_compose(*files: Path) -> subprocess.CompletedProcess:
    if find_tool("check-jsonschema") is None:
        pytest.skip("check-jsonschema not installed (pip install check-jsonschema)")
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           *map(str, files)], capture_output=True, text=True, timeout=60)


def test_compose_overrides_match_the_compose_spec(tmp_path):
    done = _check_compose(COMPOSE_TLS, COMPOSE_MUTUAL)
    assert done.returncode == 0, done.stdout + done.stderr
    merged = tmp_path / "merged.yml"
    merged.write_text(json.dumps(load_compose(overrides=(COMPOSE_TLS, COMPOSE_MUTUAL))))
    done = _check_compose(merged)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual"])
def test_every_compose_service_gets_the_secrets_at_the_paths_its_variables_name(mutual):
    overrides = (COMPOSE_TLS, COMPOSE_MUTUAL) if mutual else (COMPOSE_TLS,)
    compose = load_compose(overrides=overrides)
    plain = {c.name: c for c in compose_containers(load_compose())}
    containers = compose_containers(compose)
    assert {c.name for c in containers} == set(plain), "an override must not add or drop a service"
    secrets = compose["secrets"]
    for c in containers:
        mounted = {s["target"]: s["source"] for s in c.raw.get("secrets", [])}
        wanted = [v for v in TLS_ENV.values() if mutual or v != "FLYWHEEL_TLS_CLIENT_CA_FILE"]
        for variable in wanted:
            path = c.env.get(variable)
            assert path in mounted, f"{c.source}: {variable}={path} is not a mounted secret"
            file = Path(secrets[mounted[path]]["file"])
            assert file.name == PurePosixPath(path).name, f"{c.source}: {path} comes from {file}"
            assert file.parent == Path("./deploy/compose/tls"), file  # FLYWHEEL_TLS_DIR's default
        # Everything else is the file's own: command, healthcheck, volumes, the other variables.
        before = plain[c.name]
        assert {k: v for k, v in c.env.items() if k not in TLS_ENV.values()} == before.env, c.source
        for key in ("command", "healthcheck", "volumes", "depends_on", "ports"):
            assert c.raw.get(key) == before.raw.get(key), f"{c.source}: {key} changed"
    variable = load_compose({"FLYWHEEL_TLS_DIR": "/srv/certs"}, overrides=overrides)["secrets"]
    assert {s["file"] for s in variable.values()} == {"/srv/certs/tls.crt", "/srv/certs/tls.key", "/srv/certs/ca.crt"}


def test_compose_rollouts_are_reached_at_a_name_the_certificate_holds():
    """A compose rollout advertises its hostname; under TLS that is the service name."""
    compose = load_compose(overrides=(COMPOSE_TLS,))
    for c in compose_containers(compose):
        if c.service == "rollout":
            assert not c.env.get("FLYWHEEL_ROLLOUT__SYNCHRONIZER__ADVERTISE_ADDRESS")
            assert c.raw["hostname"] == "rollout", c.source


def test_prometheus_scrapes_the_same_targets_over_https():
    compose = load_compose(overrides=(COMPOSE_TLS,))
    prometheus = compose["services"]["prometheus"]
    config_mount = "/etc/prometheus/prometheus.yml"
    (source,) = [v.split(":")[0] for v in prometheus["volumes"] if v.split(":")[1] == config_mount]
    assert source == "./deploy/prometheus/prometheus-tls.yml"
    assert f"--config.file={config_mount}" in prometheus["command"]
    plain = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    tls = yaml.safe_load((ROOT / source).read_text())
    assert set(tls) == set(plain), "Prometheus refuses unknown top-level keys"
    mounted = {s["target"] for s in prometheus["secrets"]}
    for before, after in zip(plain["scrape_configs"], tls["scrape_configs"], strict=True):
        assert after["dns_sd_configs"] == before["dns_sd_configs"], after["job_name"]
        assert after["scheme"] == "https"
        (name,) = after["dns_sd_configs"][0]["names"]
        config = after["tls_config"]
        assert config["server_name"] == name, after["job_name"]
        assert {config["ca_file"], config["cert_file"], config["key_file"]} <= mounted, after["job_name"]


def test_plain_compose_file_stays_plaintext():
    """docker-compose.yml alone runs without TLS: the overrides add it, nothing else does."""
    compose = load_compose()
    assert "secrets" not in compose
    for c in compose_containers(compose):
        assert not set(c.env) & set(TLS_ENV.values()), c.source
