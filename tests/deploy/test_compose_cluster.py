"""docker-compose.yml deployed as written, on a namespace cluster (cluster.py),
played by compose.py, running the tiny quickstart job to completion through
the deployed controller, with the rollout service scaled to 2 replicas.

Every process runs as the image's user (the Dockerfile's USER, as Docker
runs it), on volumes owned as Docker leaves them: the test checks that each
service's process is that user, and that model-init wrote the models volume
as that user. What compose.py plays and what it knowingly ignores (fields.py)
is listed there. The job and the model come from the file's own variables:
FLYWHEEL_RUN_FILE=/etc/flywheel/examples/quickstart-tiny.yaml,
FLYWHEEL_MODEL_SOURCE=tiny (unset, a user gets the quickstart on SmolLM2).
Prometheus and Grafana (images) do not run: the test scrapes every target
prometheus.yml names, resolving its DNS names as Prometheus would, and checks
the dashboard's queries against what those scrapes export. All of that looks at
the job live: the replicas' generation is held at its first rollouts while it
runs (cluster.GenerationHold), then released, and the job runs to its end.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from flywheel.runtime.auth import read_tokens_file
from flywheel.testing.engines import with_transformers_engine
from tests.deploy.cluster import GenerationHold, NamespaceCluster, available, process_identity
from tests.deploy.compose import ComposeProject
from tests.deploy.image import image_user
from tests.deploy.manifests import ROOT, load_compose, read_env_file
from tests.deploy.observe import (
    LIVE_JOB_ENV, LIVE_STEPS, check_dashboard, check_page_in_browser, check_secure_defaults, live_status,
    replica_versions, replica_work, scrape,
)

pytestmark = pytest.mark.slow

WHY_NOT = available()
VARIABLES = {
    **read_env_file(ROOT / ".env"),  # COMPOSE_PROFILES=cpu, as `docker compose up` reads it
    "FLYWHEEL_RUN_FILE": "/etc/flywheel/examples/quickstart-tiny.yaml",
    "FLYWHEEL_MODEL_SOURCE": "tiny",
}
#: Replicas per service (`--scale`); FLYWHEEL_TEST_ROLLOUT_SCALE=3 checks `--scale rollout=3`.
SCALE = {"rollout": int(os.environ.get("FLYWHEEL_TEST_ROLLOUT_SCALE", "2"))}
JOB_TIMEOUT = 780.0


def long_job() -> dict:
    """docker-compose.yml with the controller's job run for LIVE_STEPS steps."""
    compose = load_compose(VARIABLES)
    controller = compose["services"]["controller"]
    controller["environment"] = {**(controller.get("environment") or {}), **LIVE_JOB_ENV}
    return compose


def prometheus_targets(cluster: NamespaceCluster) -> dict[str, list[str]]:
    """job -> the host:port addresses Prometheus would scrape (its dns_sd_configs, type A)."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {}
    for job in config["scrape_configs"]:
        found = []
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                found += [f"{address}:{sd['port']}" for address in cluster.resolve(name)]
        for static in job.get("static_configs", []):
            found += static["targets"]
        targets[job["job_name"]] = found
    return targets


@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
def test_compose_runs_the_job_with_two_replicas(tmp_path: Path) -> None:
    with NamespaceCluster(tmp_path) as cluster:
        project = ComposeProject(cluster, tmp_path, VARIABLES, scale=SCALE, compose=long_job())
        assert set(project.containers) == {"tokens-init", "model-init", "synchronizer", "trainer", "rollout", "controller"}
        deadline, hold = time.monotonic() + JOB_TIMEOUT, GenerationHold()

        def hold_the_replicas(container) -> None:  # the controller starts once they are healthy (depends_on)
            if container.service == "controller":
                hold.hold([c.proc.pid for c in project.containers["rollout"]])

        try:
            # Everything below until the release looks at the job live: its replicas are held at its first rollouts.
            project.up(deadline, before_start=hold_the_replicas)
            (controller,) = project.containers["controller"]
            ip = controller.host.address
            status_env = {k: v for k, v in controller.env.items() if k.startswith("FLYWHEEL_CONTROLLER__")}
            page = f"http://{ip}:{status_env['FLYWHEEL_CONTROLLER__STATUS_PORT']}/"
            # The tokens tokens-init generated (what `tokens-init ... tokens show SCOPE` prints).
            tokens = {str(scope): listed[0] for scope, listed in
                      read_tokens_file(project.volumes["flywheel-tokens"] / "tokens.yaml").items()}

            # While the job runs: the status page shows every component, Prometheus's targets answer.
            body = {}
            while not body:
                assert controller.proc.poll() is None, f"controller exited early:\n{controller.tail()}"
                assert time.monotonic() < deadline
                try:
                    body = live_status(page, ["rollout"] * SCALE["rollout"] + ["trainer"], tokens["viewer"], steps_done=0)
                except OSError:
                    pass
                time.sleep(0.3)
            replica_ids = {c["id"] for c in body["components"] if c["role"] == "rollout"}
            # Every service runs as the image's user, as Docker runs it (no compose `user:` overrides it);
            # read now that each (the controller included) is past its start-up and serving.
            image = image_user("cpu")
            running = {c.name: process_identity(c.proc.pid) for cs in project.containers.values() for c in cs
                       if c.service not in ("model-init", "tokens-init")}
            assert len(running) == 3 + SCALE["rollout"] and running == {
                name: {"uid": image.uid, "gid": image.gid, "groups": ()} for name in running}, running
            scrapes = {}
            for job, targets in prometheus_targets(cluster).items():
                if job == "tinker":  # the Tinker gateway runs in the tinker profile, not this job's
                    assert not targets, targets
                    continue
                assert targets, f"prometheus job {job}: no target resolves"
                scrapes.update(scrape(targets))
            assert len(scrapes) == 3 + SCALE["rollout"]  # synchronizer, trainer, controller, each rollout
            check_dashboard(scrapes)
            check_page_in_browser(f"{page}#token={tokens['viewer']}", ["trainer-0", *replica_ids])
            (trainer,), (synchronizer,) = project.containers["trainer"], project.containers["synchronizer"]
            check_secure_defaults(page, f"{trainer.host.address}:50052", f"{synchronizer.host.address}:50051", tokens)

            assert live_status(page, ["rollout"] * SCALE["rollout"] + ["trainer"], tokens["viewer"], steps_done=0), \
                "the job trained while its replicas were held: the checks above did not see it at a known step"
            hold.release()
            code = controller.proc.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, controller.tail()
            # The replicas, still up, say themselves that they generated and moved to new weights.
            work = replica_work(prometheus_targets(cluster)["rollout"])
        finally:
            hold.release()
            logs = {c.name: c.tail(1500) for cs in project.containers.values() for c in cs}
            cluster.stop()
        # model-init ran as the image's user: everything it wrote to the models volume is that user's.
        written = [p for p in (project.volumes["models"] / "policy").rglob("*")]
        assert written and {(p.stat().st_uid, p.stat().st_gid) for p in written} == {(image.uid, image.gid)}, written
        run_dir = project.volumes["flywheel-data"] / "runs" / "quickstart-tiny"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["last_step"] == LIVE_STEPS and summary["exit_code"] == 0, (summary, logs)
        # Every replica generated trained samples, and each did so on new weights.
        newest = replica_versions((run_dir / "trained_tasks.jsonl").read_text())
        assert set(newest) == replica_ids, (newest, replica_ids)
        assert all(version >= 5 for version in newest.values()), newest
        assert len(work) == SCALE["rollout"] and all(tokens > 0 and version >= 5 for tokens, version in work.values()), work



def checkpoint_sync_examples(directory: Path) -> Path:
    """The repository's examples/ with quickstart-tiny switched to CHECKPOINT weight sync (and the
    transformers engine), as a user mounts their own run files at /etc/flywheel/examples (the compose
    file's FLYWHEEL_RUN_FILE)."""
    directory.mkdir(parents=True)
    for example in (ROOT / "examples").iterdir():
        if example.is_file():
            (directory / example.name).write_bytes(example.read_bytes())
    run = yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())
    run["sync"] = {**run.get("sync", {}), "method": "checkpoint"}
    # The engine is not this test's subject (the two-replica run keeps vLLM, and tests/integration loads
    # checkpoints into vLLM): the run file puts the rollout on the transformers engine, as a user's would.
    with_transformers_engine(run)
    (directory / "quickstart-tiny.yaml").write_text(yaml.safe_dump(run))
    return directory


def committed_methods(run_dir: Path) -> set[str]:
    events = [json.loads(line) for line in (run_dir / "synchronizer_events.jsonl").read_text().splitlines() if line]
    return {e.get("method") for e in events if e["kind"] == "VERSION_COMMITTED"}


@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
def test_compose_trains_with_checkpoint_weight_sync(tmp_path: Path) -> None:
    """sync.method: checkpoint works where compose ships it: the trainer publishes each version to
    /data/published on the flywheel-data volume, the synchronizer verifies it there and the rollout
    loads it from the same path (both mount the volume read-only; their checkpoint_root)."""
    compose = load_compose(VARIABLES)
    examples = str(checkpoint_sync_examples(tmp_path / "examples"))
    for service in compose["services"].values():
        service["volumes"] = [f"{examples}:/etc/flywheel/examples:ro" if v.endswith(":/etc/flywheel/examples:ro")
                              else v for v in service.get("volumes", [])]
    with NamespaceCluster(tmp_path) as cluster:
        project = ComposeProject(cluster, tmp_path, VARIABLES, compose=compose)
        deadline = time.monotonic() + JOB_TIMEOUT
        try:
            project.up(deadline)
            (controller,) = project.containers["controller"]
            code = controller.proc.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, controller.tail()
        finally:
            logs = {c.name: c.tail(1500) for cs in project.containers.values() for c in cs}
            cluster.stop()
    run_dir = project.volumes["flywheel-data"] / "runs" / "quickstart-tiny"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == 10 and summary["exit_code"] == 0, (summary, logs)
    assert committed_methods(run_dir) == {"CHECKPOINT"}, logs
    published = sorted(p.name for p in (project.volumes["flywheel-data"] / "published").iterdir())
    assert published, "no version was published to /data/published"
    newest = replica_versions((run_dir / "trained_tasks.jsonl").read_text())
    assert newest and all(version >= 5 for version in newest.values()), newest
