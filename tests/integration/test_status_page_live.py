"""The controller service around a live run, the way a user meets it.

`python -m services.controller run` on the tiny quickstart (made long enough
to watch), with real services:
- it prints the status page's URL, and the page, loaded in headless Chromium
  (Debian's `chromium`), shows the trainer and the rollout with their weight
  versions, and a reward curve that grows between two loads;
- the same process answers the controller's gRPC Status (every component as
  the synchronizer sees it), health SERVING, and /metrics with the
  controller's families;
- a gRPC Stop ends the run after a checkpoint, and the launcher exits 0.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flywheel.controller.v1 import controller_pb2 as pb
from flywheel.controller.v1 import controller_pb2_grpc as pb_grpc
from flywheel.runtime.auth import Scope, read_tokens_file
from flywheel.testing.engines import with_transformers_engine
from flywheel.runtime.tokens import init as init_tokens
from tests.deploy.observe import CHROMIUM, NO_CHROMIUM, chromium

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT_ENV = "FLYWHEEL_STATUS_SCREENSHOT"  # where to keep the screenshot (the test writes one in its tmp dir)


def long_tiny_run(tmp_path: Path) -> Path:
    # The transformers engine: the page is the subject, and vLLM's start would be half the test's time.
    data = with_transformers_engine(yaml.safe_load((ROOT / "examples/quickstart-tiny.yaml").read_text()))
    data["run"]["max_steps"] = 100_000  # ended by Stop
    data["launch"]["dataset"]["train_size"] = 4000
    path = tmp_path / "long-tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def wait_for(what: str, ready, proc: subprocess.Popen, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}) while waiting for {what}")
        try:
            value = ready()
            if value:
                return value
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def get_json(url: str, token: str | None = None) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=5) as reply:
        return json.loads(reply.read())


def test_the_status_page_follows_a_live_run(tmp_path: Path) -> None:
    assert CHROMIUM is not None, NO_CHROMIUM
    run_dir = tmp_path / "run"
    ready_file = tmp_path / "controller.ready"
    # Scoped tokens, as deployed: the launcher's services and its status page all read them.
    tokens_file = tmp_path / "tokens.yaml"
    init_tokens(tokens_file)
    tokens = {scope: listed[0] for scope, listed in read_tokens_file(tokens_file).items()}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLYWHEEL_MODEL_CACHE": str(tmp_path / "models"),
           "FLYWHEEL_CONTROLLER__STATUS_PORT": "0", "FLYWHEEL_CONTROLLER__SERVER__READY_FILE": str(ready_file),
           "FLYWHEEL_TOKENS_FILE": str(tokens_file)}
    out = (tmp_path / "launcher.out").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.controller", "run", str(long_tiny_run(tmp_path)), "--run-dir", str(run_dir)],
        cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    try:
        # The link a user opens: the page with the viewer token in its fragment (which browsers never send);
        # the run directory's copy holds no token.
        url = wait_for("the status page URL", lambda: re.search(
            r"status page: (http://\S+)", (tmp_path / "launcher.out").read_text()), proc).group(1)
        page, _, fragment = url.partition("#")
        assert fragment == f"token={tokens[Scope.VIEWER]}" and (run_dir / "status_url").read_text().strip() == page
        api = page + "api/status"
        body = wait_for("two components and three steps", lambda: (
            (b := get_json(api, tokens[Scope.VIEWER]))["step"] >= 3
            and {c["role"] for c in b["components"]} == {"trainer", "rollout"} and b
        ), proc)
        for token in (None, "wrong"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                get_json(api, token)
            assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"
        refused_page = chromium(page, "--dump-dom")  # no token: the page says what it needs, and shows nothing
        assert 'data-refused="401"' in refused_page and "viewer token" in refused_page
        assert 'data-id="trainer-0"' not in refused_page
        assert body["phase"] == "running" and body["trainer_version"] >= 3
        rollout = next(c for c in body["components"] if c["role"] == "rollout")
        assert rollout["weight_version"] >= 1 and rollout["state"] in ("running", "require_sync", "synchronizing")

        # The page as a browser renders it: components, versions, a curve that grows.
        first = chromium(url, "--dump-dom")
        assert 'data-id="trainer-0"' in first and 'data-id="rollout-0"' in first, first[-3000:]
        points = lambda dom: int(re.search(r'id="reward-chart"[^>]*data-points="(\d+)"', dom).group(1))  # noqa: E731
        # The run goes on: once the API has a point the first render did not draw, a second render shows it.
        wait_for("a reward point after the first render", lambda: len(
            get_json(api, tokens[Scope.VIEWER])["curves"]["reward"]) > points(first), proc)
        second = chromium(url, "--dump-dom")
        assert points(second) > points(first) >= 3
        assert re.search(r'<span id="connection" class="">live, updated', second), "the page polled successfully"
        shot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "status.png")
        chromium(url, f"--screenshot={shot}")
        assert shot.stat().st_size > 10_000

        # The same process is the controller service.
        ports = json.loads(ready_file.read_text())
        operator = [("authorization", f"Bearer {tokens[Scope.OPERATOR]}")]
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc_port']}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.ControllerServiceStub(channel)
            status = stub.Status(pb.StatusRequest(), timeout=5, metadata=operator)
            assert status.phase == pb.RUN_PHASE_RUNNING and status.step >= 3
            assert {c.identity.id for c in status.components} == {"trainer-0", "rollout-0"}
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics_port']}/metrics", timeout=5) as reply:
                metrics = reply.read().decode()
            assert re.search(r'^flywheel_service_ready\{service="controller"\} 1\.0$', metrics, re.M)
            assert float(re.search(r"^flywheel_controller_trainer_step (\S+)$", metrics, re.M).group(1)) >= 3
            stopped = stub.Stop(pb.StopRequest(checkpoint=True, grace_seconds=120), timeout=150, metadata=operator)
        assert stopped.checkpoint_path, "Stop with checkpoint=True returns the checkpoint written"
        assert proc.wait(120) == 0, (tmp_path / "launcher.out").read_text()[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert "stop" in summary["stop_reason"], summary
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
