"""The deployment files against the real service processes.

- The Grafana dashboard queries only metric names (and labels) that a live
  `/metrics` scrape of the four services shows.
- Every service exports the families its `services/<name>/metrics.py` declares.
- The image's healthcheck script tells SERVING from not serving.
- Each service started with ONLY the environment a manifest gives its
  container (ports swapped for free ones, host 127.0.0.1, absolute paths moved
  under a temp dir) reaches SERVING on grpc.health.v1, serves /metrics on the
  configured port and enforces the configured auth token.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from flywheel.runtime.auth import TOKENS_FILE_ENV, Scope, read_tokens_file
from flywheel.runtime.tokens import add_tenant_key
from flywheel.runtime.config import resolve
from flywheel.runtime.tokens import init as init_tokens
from tests.conftest import MODEL_FLAGS
from tests.deploy.manifests import ROOT, SERVICES, Container, clean_env, config_class
from flywheel.testing.net import free_port

START_TIMEOUT = 60.0
DASHBOARD = ROOT / "deploy/grafana/dashboards/flywheel.json"
HEALTHCHECK = ROOT / "deploy/docker/healthcheck.py"
# Labels Prometheus adds itself or that histograms carry.
IMPLICIT_LABELS = {"le", "instance", "job"}


def _stop(children: list[subprocess.Popen]) -> None:
    for child in children:
        child.terminate()
    for child in children:
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def _wait(what: str, ready, child: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if child.poll() is not None:
            pytest.fail(f"{what} exited with {child.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if ready():
                return
        except (OSError, grpc.RpcError):
            pass
        time.sleep(0.2)
    pytest.fail(f"{what} not ready after {START_TIMEOUT}s:\n{log.read_text()[-3000:]}")


# ---------------------------------------------------------------- live scrape


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory, service_model) -> Iterator[dict[str, dict]]:
    """service -> {"text": /metrics body, "grpc_port": int}, from real processes on free ports
    that have answered one request."""
    tmp = tmp_path_factory.mktemp("scrape")
    children, ready_files = [], {}
    try:
        for service in SERVICES:
            if service == "tinker":
                continue  # started below, once the trainer it fronts has a port
            ready_files[service] = tmp / f"{service}.json"
            log = tmp / f"{service}.log"
            argv = [sys.executable, "-m", f"services.{service}", "--server.port", "0", "--server.metrics-port", "0"]
            argv += ["--server.ready-file", str(ready_files[service]), "--server.log-format", "text"]
            # HTTP ports free too: a default (the controller's status page on 8080) may be held by a local run.
            fields = config_class(service).model_fields
            for name, flag in (("status_port", "--status-port"), ("http_port", "--http-port")):
                if name in fields:
                    argv += [flag, "0"]
            argv += MODEL_FLAGS.get(service, lambda _: ())(service_model)
            children.append(
                subprocess.Popen(argv, env=clean_env({}, tmp), cwd=tmp, stdout=log.open("w"), stderr=subprocess.STDOUT)
            )
        found = {}
        for service, child in zip([s for s in SERVICES if s != "tinker"], children):
            _wait(service, ready_files[service].exists, child, tmp / f"{service}.log")
            info = json.loads(ready_files[service].read_text())
            # One request first: RPC metrics are labelled by method and appear with traffic.
            _call_code(info["grpc_port"], _unary_method(service), None)
            found[service] = {"text": _scrape(info["metrics_port"]), "grpc_port": info["grpc_port"]}
        if "tinker" in SERVICES:  # the gateway, in front of that trainer; its traffic is HTTP
            ready_files["tinker"] = tmp / "tinker.json"
            log = tmp / "tinker.log"
            argv = [sys.executable, "-m", "services.tinker", "--server.port", "0", "--server.metrics-port", "0",
                    "--server.ready-file", str(ready_files["tinker"]), "--server.log-format", "text",
                    "--http-port", "0", "--trainer-address", f"127.0.0.1:{found['trainer']['grpc_port']}",
                    "--checkpoint-dir", str(tmp / "checkpoints" / "tinker")]  # inside the trainer's (cwd-relative)
            children.append(subprocess.Popen(argv, env=clean_env({}, tmp), cwd=tmp, stdout=log.open("w"),
                                             stderr=subprocess.STDOUT))
            _wait("tinker", ready_files["tinker"].exists, children[-1], log)
            info = json.loads(ready_files["tinker"].read_text())
            assert _tinker_code(_http_port(ready_files["tinker"]), "GET", "/api/v1/healthz", None) == 200
            found["tinker"] = {"text": _scrape(info["metrics_port"]), "grpc_port": info["grpc_port"]}
        yield found
    finally:
        _stop(children)


def _samples(text: str) -> dict[str, set[str]]:
    """sample name (with _total/_bucket/... suffixes) -> label names seen on it."""
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_exported_metrics(scrapes):
    exported: dict[str, set[str]] = {}
    for scrape in scrapes.values():
        for name, labels in _samples(scrape["text"]).items():
            exported.setdefault(name, set()).update(labels)
    queries = _dashboard_queries()
    assert queries
    for expr in queries:
        names = set(re.findall(r"\bflywheel_[a-z0-9_]+\b", expr))
        assert names, f"query uses no Flywheel metric: {expr}"
        missing = names - set(exported)
        assert not missing, f"{expr}: {sorted(missing)} not in any service's /metrics"
        # Labels it groups by, selects on or prints must exist on some metric it reads.
        labels = set(IMPLICIT_LABELS).union(*(exported[n] for n in names))
        used = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
        used |= set(re.findall(r"[{,]\s*([a-z_]+)\s*=~?", expr))
        assert used <= labels, f"{expr}: labels {sorted(used - labels)} do not exist"


#: Where a service declares its metrics, when not in services/<name>/metrics.py (the controller's
#: telemetry wing).
METRICS_MODULES = {"controller": "services.controller.telemetry.metrics"}


def _declared_families(service: str) -> set[str]:
    module = importlib.import_module(METRICS_MODULES.get(service, f"services.{service}.metrics"))
    families = set()
    for value in vars(module).values():
        if isinstance(value, MetricWrapperBase):
            families |= {family.name for family in value.describe()}
    return families


@pytest.mark.parametrize("service", SERVICES)
def test_service_exports_its_metrics_module(scrapes, service):
    declared = _declared_families(service)
    assert declared, f"{METRICS_MODULES.get(service, f'services.{service}.metrics')} declares no metrics"
    exported = {family.name for family in text_string_to_metric_families(scrapes[service]["text"])}
    missing = declared - exported
    assert not missing, (
        f"{service} does not export {sorted(missing)}: does services/{service}/app.py import its metrics module?"
    )
    assert "flywheel_service_ready" in exported


def test_healthcheck_script_tells_serving_from_unreachable(scrapes, tmp_path):
    port = scrapes["synchronizer"]["grpc_port"]

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        argv = [sys.executable, str(HEALTHCHECK), *args]
        return subprocess.run(argv, check=False, env=clean_env(env or {}, tmp_path), capture_output=True, text=True)

    ok = run(f"127.0.0.1:{port}")
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    from_env = run(env={"FLYWHEEL_SYNCHRONIZER__SERVER__PORT": str(port)})
    assert from_env.returncode == 0, from_env.stderr
    down = run(f"127.0.0.1:{free_port()}")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


# ---------------------------------------------------------------- manifest env only


def localize(container: Container, tmp: Path, model: Path) -> dict[str, str]:
    """The container's env made runnable here: free ports, loopback, paths under tmp,
    the model path at the model-init step's output."""
    env = {}
    for name, value in container.env.items():
        if name.endswith(("__MODEL__PATH", "__MODEL_PATH")):
            value = str(model)
        elif name.endswith("__HOST"):
            value = "127.0.0.1"
        elif name.endswith("PORT"):
            value = str(free_port())
        elif value.startswith("/"):
            value = str(tmp / value.lstrip("/"))
            Path(value).parent.mkdir(parents=True, exist_ok=True)
        env[name] = value
    if TOKENS_FILE_ENV in env:  # what the Secret (Kubernetes) or tokens-init (compose) holds
        init_tokens(Path(env[TOKENS_FILE_ENV]))
    if container.service == "rollout":
        # What is checked here is the server's configuration; the engine (vLLM, with the
        # run file's arguments) is started as deployed by the namespace-cluster tests.
        env["FLYWHEEL_ROLLOUT__ENGINE__KIND"] = "transformers"
    return env


def _token(env: dict[str, str], scope: Scope) -> str | None:
    return read_tokens_file(Path(env[TOKENS_FILE_ENV]))[scope][0] if env.get(TOKENS_FILE_ENV) else None


def _unary_method(service: str) -> str:
    proto = importlib.import_module(f"flywheel.{service}.v1.{service}_pb2")
    (svc,) = proto.DESCRIPTOR.services_by_name.values()
    method = next(m for m in svc.methods if not m.client_streaming and not m.server_streaming)
    return f"/{svc.full_name}/{method.name}"


def _call(port: int, path: str, token: str | None) -> tuple[grpc.StatusCode, str]:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            channel.unary_unary(path)(b"", timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _call_code(port: int, path: str, token: str | None) -> grpc.StatusCode:
    return _call(port, path, token)[0]


def _status_page_code(port: int, token: str | None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/status",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _http_port(ready_file: Path) -> int:
    from flywheel.runtime.http_server import http_ready_file

    return json.loads(http_ready_file(ready_file).read_text())["http_port"]


def _tinker_code(port: int, method: str, path: str, key: str | None) -> int:
    """The HTTP status of a Tinker API call with `key` as the SDK sends it (X-API-Key)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     data=b"{}" if method == "POST" else None,
                                     headers={"X-API-Key": key, "Content-Type": "application/json"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


#: The gateway's addresses, by the service each names: pointed at that container's local port here.
_TINKER_ADDRESSES = {"FLYWHEEL_TINKER__TRAINER_ADDRESS": "trainer", "FLYWHEEL_TINKER__ROLLOUT_ADDRESS": "rollout"}


def start_from_manifest(containers: list[Container], tmp: Path, model: Path) -> None:
    started = []
    localized: dict[str, dict[str, str]] = {}
    # The Tinker gateway shares the trainer's and rollout's volumes and tokens, as deployed: one root for all.
    shared = any(c.service == "tinker" for c in containers)
    try:
        # The gateway last: it dials the trainer and rollout the others' localized ports name.
        for c in sorted(containers, key=lambda c: c.service == "tinker"):
            home = tmp / c.name
            home.mkdir()
            env = localize(c, tmp / "shared" if shared else home, model)
            localized[c.service] = env
            if c.service == "tinker":
                for name, service in _TINKER_ADDRESSES.items():
                    prefix = f"FLYWHEEL_{service.upper()}__SERVER__PORT"
                    env[name] = f"127.0.0.1:{localized[service][prefix]}"
            log = home / "log"
            # The controller's `run CONFIG` starts a training run; its server
            # configuration is what is checked here, so it starts as a server.
            # The image's `python` is this interpreter here.
            argv = [sys.executable, *c.command[1:]]
            child = subprocess.Popen(
                argv, env=clean_env(env, home), cwd=home, stdout=log.open("w"), stderr=subprocess.STDOUT
            )
            config = resolve(config_class(c.service), env=env, env_prefix=c.prefix)
            started.append((c, child, log, env, config))
        for c, child, log, env, config in started:
            port = config.server.port
            _wait(c.source, lambda p=port: _health(p) == health_pb2.HealthCheckResponse.SERVING, child, log)
            assert "flywheel_service_ready" in _scrape(config.server.metrics_port), c.source
            if c.service == "tinker":  # the Tinker API: the SDK's X-API-Key, a tenant's key (the gateway re-reads
                http = config.http_port  # the tokens file: an operator adds a tenant to a running deployment)
                tenant_key = add_tenant_key(Path(env[TOKENS_FILE_ENV]), "alice")
                assert _tinker_code(http, "POST", "/api/v1/create_session", None) == 401, c.source
                for services_only in (Scope.AGENT, Scope.SERVICE):  # tokens the services use open no Tinker API
                    assert _tinker_code(http, "POST", "/api/v1/create_session", _token(env, services_only)) == 403, \
                        c.source
                deadline = time.monotonic() + 10  # the gateway looks at the file at most once a second
                while (code := _tinker_code(http, "POST", "/api/v1/create_session", tenant_key)) != 200 \
                        and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert code == 200, c.source
                continue
            token, method = _token(env, Scope.OPERATOR), _unary_method(c.service)
            assert token, f"{c.source}: no auth token"
            assert _call_code(port, method, None) == grpc.StatusCode.UNAUTHENTICATED, f"{c.source}: auth is off"
            assert _call_code(port, method, token) != grpc.StatusCode.UNAUTHENTICATED, f"{c.source}: token refused"
            if c.service in ("trainer", "synchronizer"):  # an agent's token does not train or move weights
                code, details = _call(port, method, _token(env, Scope.AGENT))
                assert code == grpc.StatusCode.PERMISSION_DENIED and details.endswith(
                    "needs scope service or operator; this token has scope agent"), (c.source, code, details)
            if c.service == "controller":  # the status page's JSON: a viewer token, not none
                assert _status_page_code(config.status_port, None) == 401, c.source
                assert _status_page_code(config.status_port, "wrong") == 401, c.source
                assert _status_page_code(config.status_port, _token(env, Scope.VIEWER)) == 200, c.source
    finally:
        _stop([child for _, child, *_ in started])


RUN_SERVICES = ("synchronizer", "trainer", "rollout", "controller")
TINKER_SERVICES = ("synchronizer", "trainer", "rollout", "tinker")


@pytest.mark.parametrize("overlay, services", [("cpu", RUN_SERVICES), ("tinker", TINKER_SERVICES)])
def test_services_start_with_only_the_kubernetes_env(k8s, tmp_path, service_model, overlay, services):
    containers = [c for c in k8s if c.source.startswith(f"kubernetes/{overlay} ")]
    assert sorted(c.service for c in containers) == sorted(services)
    start_from_manifest(containers, tmp_path, service_model)


@pytest.mark.parametrize("profile, services", [("cpu", RUN_SERVICES), ("tinker", TINKER_SERVICES)])
def test_services_start_with_only_the_compose_env(composed, tmp_path, service_model, profile, services):
    containers = [c for c in composed if profile in c.raw.get("profiles", [profile])]
    assert sorted(c.service for c in containers) == sorted(services)
    start_from_manifest(containers, tmp_path, service_model)
