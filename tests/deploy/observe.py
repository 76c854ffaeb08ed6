"""What a user looks at on a deployed job, shared by the cluster tests: the
controller's status page (JSON and, in headless Chromium, the rendered DOM),
every /metrics target, and the Grafana dashboard's queries against them."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.manifests import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = ("headless Chromium is not installed (Debian package `chromium`, which .ci/run installs): "
               "the status page's browser check cannot run")


#: Steps of the job the cluster tests run, over the run file's 10: enough for every replica to generate on
#: version 5 or later, which the tests check. They look at the job live with its replicas held at its first
#: rollouts (tests.deploy.cluster.GenerationHold), so the steps' speed does not decide what they see. A
#: multiple of 10: the run file's data is one epoch of 10 steps.
LIVE_STEPS = 20
#: The variables that set it (`FLYWHEEL_RUN__*`, as a user's overlay or override file sets them); the
#: run file's 40 tasks are one epoch of 10 steps.
LIVE_JOB_ENV = {"FLYWHEEL_RUN__RUN__MAX_STEPS": str(LIVE_STEPS), "FLYWHEEL_RUN__DATA__EPOCHS": str(LIVE_STEPS // 10)}


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None,
             context: ssl.SSLContext | None = None) -> bytes:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
        return reply.read()


def live_status(page: str, roles: list[str], token: str, steps_done: int) -> dict:
    """The status page's JSON (asked with `token`, a viewer's) once it lists exactly these running roles
    at `steps_done` trained steps (0: a job whose replicas' generation is held, GenerationHold), else {}."""
    body = json.loads(http_get(page + "api/status", headers={"Authorization": f"Bearer {token}"}))
    running = sorted(c["role"] for c in body["components"] if c["state"] != "stopped")
    return body if running == sorted(roles) and body["step"] == steps_done else {}


def check_secure_defaults(page: str, trainer: str, synchronizer: str, tokens: dict[str, str]) -> None:
    """What a default deployment refuses: the status page's JSON without a token or with a wrong one
    (401), and an agent's token on the trainer's and the synchronizer's RPCs (PERMISSION_DENIED,
    naming the scope they need). `tokens`: the deployment's tokens file, scope -> token."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(urllib.error.HTTPError) as refused:
            http_get(page + "api/status", headers=headers)
        assert refused.value.code == 401, headers
    for address, service in ((trainer, "trainer"), (synchronizer, "synchronizer")):
        proto = importlib.import_module(f"flywheel.{service}.v1.{service}_pb2")
        (described,) = proto.DESCRIPTOR.services_by_name.values()
        method = next(m for m in described.methods if not m.client_streaming and not m.server_streaming)
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary(f"/{described.full_name}/{method.name}")(
                    b"", timeout=10, metadata=[("authorization", f"Bearer {tokens['agent']}")])
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, (service, refused.value)
        assert refused.value.details() == f"{method.name} needs scope service or operator; this token has scope agent"


def scrape(targets: list[str]) -> dict[str, str]:
    """host:port -> its /metrics text; each must export flywheel_service_ready."""
    scrapes = {}
    for target in targets:
        scrapes[target] = http_get(f"http://{target}/metrics").decode()
        assert "flywheel_service_ready" in scrapes[target], target
    return scrapes


def check_dashboard(scrapes: dict[str, str]) -> None:
    """Every metric a dashboard panel queries is exported by some target: the panel has data."""
    exported = {s.name for text in scrapes.values() for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/flywheel.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names = set(re.findall(r"\bflywheel_[a-z0-9_]+\b", target["expr"]))
            assert names <= exported, f"dashboard query {target['expr']}: {names - exported} not scraped"


def chromium(url: str, *args: str) -> str:
    """Headless Chromium on `url` after its scripts ran for 4 s of virtual time (e.g. `--dump-dom`,
    `--screenshot=FILE`); its stdout."""
    assert CHROMIUM is not None, NO_CHROMIUM
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1000",
         "--virtual-time-budget=4000", *args, url],
        capture_output=True, text=True, timeout=90).stdout


def check_page_in_browser(page: str, component_ids: list[str]) -> None:
    """The page as Chromium renders it (scripts run) shows every component. Without Chromium this
    fails: a browser check that passes unseen would prove nothing."""
    assert CHROMIUM, NO_CHROMIUM
    dom = chromium(page, "--dump-dom")
    for cid in component_ids:
        assert f'data-id="{cid}"' in dom, f"status page lacks {cid}"


def replica_versions(trained_tasks: str) -> dict[str, int]:
    """engine -> the newest weight version it generated a trained sample with (trained_tasks.jsonl)."""
    newest: dict[str, int] = {}
    for line in trained_tasks.splitlines():
        row = json.loads(line)
        for engine, (start, _end) in zip(row["sample_engines"], row["sample_versions"]):
            newest[engine] = max(newest.get(engine, 0), start)
    return newest


def replica_work(metrics_targets: list[str]) -> dict[str, tuple[float, float]]:
    """Each rollout replica's own account, from its /metrics: (completion tokens it
    generated, the weight version it serves). The controller's attribution of samples
    to replicas is not evidence that a replica did the work; this is."""
    work = {}
    for target in metrics_targets:
        values = {s.name: s.value for f in text_string_to_metric_families(http_get(f"http://{target}/metrics").decode())
                  for s in f.samples}
        work[target] = (values.get("flywheel_rollout_generated_tokens_total", 0.0),
                        values.get("flywheel_rollout_weight_version", 0.0))
    return work
