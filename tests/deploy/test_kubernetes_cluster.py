"""The rendered Kubernetes cpu overlay deployed on a namespace cluster (kube.py:
pods as network namespaces, Services as DNS names and virtual IPs, probes run
as the kubelet runs them), running the tiny quickstart job until the
controller Job completes.

Nothing in the overlay is stripped or rewritten. What the test chooses, it
chooses the way a user would, in its own overlay on top of overlays/cpu:
- `replicas: flywheel-rollout 2` (as `kubectl scale` would);
- ConfigMap flywheel-job merged with run_file=/etc/flywheel/examples/
  quickstart-tiny.yaml and model_source=tiny (a user's own job goes the same way);
- Secret flywheel-tokens created from the tokens file deploy/README.md's command
  writes (`python -m flywheel.runtime.tokens init tokens.yaml`, then
  `kubectl create secret generic flywheel-tokens --from-file=tokens.yaml`); the
  cpu overlay's test checks what that default refuses: the status page's JSON
  without a token, an agent's token on the trainer's and synchronizer's RPCs.
The image is this repository: its `python` is the virtualenv's and the files
the Dockerfile COPYs (examples/, the healthcheck script) are bound from here.
Every container runs as its securityContext (else the image's USER) says, on
volumes owned as the kubelet leaves them, fsGroup included; the test checks
each container's ids and privileges and who wrote the models volumes. What
kube.py does not emulate is listed there and in fields.py.

The NetworkPolicies are enforced (netpol.py: nftables in each pod's network
namespace). Beside the overlay the cpu test runs two pods of its own, as
`kubectl run` would, labelled outside the policies: `outsider` is refused on
every Flywheel pod's service ports, directly and through a Service, while
the project's pods are served there and `outsider` itself is served by
`bystander` (no policy selects it), so the refusal is the policy's. Those checks
look at the job live: its rollout replicas' generation is held at its first
rollouts while they run (cluster.GenerationHold), then released, and the job runs
to its end; a run of the tiny model can otherwise end in seconds.

The TLS variant adds components/tls and components/tls-mutual to that overlay and
creates Secret flywheel-tls from the certificate deploy/README.md's command makes,
and runs its own job file (quickstart-tiny with sync.method: checkpoint and its
rollouts on the transformers engine, in the flywheel-run ConfigMap) to completion:
a plaintext client and one without a certificate are refused, and every version
travels as a checkpoint on the claim the trainer, synchronizer and rollouts mount.
Its rollout pods start once the controller's pod has been checked, while its run
waits for them: that run ends in seconds, sooner than the Job's probes first pass.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import time
import urllib.error
from pathlib import Path

import grpc
import yaml
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flywheel.common.v1 import common_pb2
from flywheel.synchronizer.v1 import synchronizer_pb2, synchronizer_pb2_grpc

from flywheel.runtime.auth import read_tokens_file
from flywheel.runtime.tokens import init as init_tokens
from flywheel.testing.engines import with_transformers_engine
from tests.deploy.cluster import GenerationHold, NamespaceCluster, available, process_identity, process_privileges
from tests.deploy.kube import Kube
from tests.deploy.pods import Pod, container_port
from tests.deploy.manifests import ROOT, readme_cert_hosts, user_overlay
from tests.deploy.manifests import render as render_dir
from tests.deploy.netpol import http_get_from, reach_all
from tests.deploy.observe import (
    LIVE_JOB_ENV, LIVE_STEPS, check_dashboard, check_page_in_browser, check_secure_defaults, http_get, live_status, replica_versions, replica_work, scrape,
)

pytestmark = pytest.mark.slow

# Without nft (.ci/run installs nftables) Kube refuses to run the policies unenforced: a failure, not a skip.
WHY_NOT = available()
ROLLOUTS = 2
JOB = {"run_file": "/etc/flywheel/examples/quickstart-tiny.yaml", "model_source": "tiny"}
JOB_TIMEOUT = 780.0


def render(tmp_path: Path, components: tuple[str, ...] = (), run_file: dict | None = None) -> list[dict]:
    """The cpu overlay with `components`, as a user's overlay; `run_file`: the job's own run file, added
    to the flywheel-run ConfigMap (mounted at /etc/flywheel/run) as deploy/README.md shows."""
    job, generators = dict(JOB), []
    if run_file is not None:
        (tmp_path / "overlay").mkdir(parents=True, exist_ok=True)
        (tmp_path / "overlay" / "job.yaml").write_text(yaml.safe_dump(run_file))
        generators.append({"name": "flywheel-run", "behavior": "merge", "files": ["job.yaml"]})
        job["run_file"] = "/etc/flywheel/run/job.yaml"
    overlay = user_overlay(
        tmp_path / "overlay", "cpu", components,
        replicas=[{"name": "flywheel-rollout", "count": ROLLOUTS}],
        configMapGenerator=[
            {"name": "flywheel-job", "behavior": "merge", "literals": [f"{k}={v}" for k, v in job.items()]},
            *generators],
    )
    objects = render_dir(overlay)
    for job_object in (o for o in objects if o["kind"] == "Job"):
        for container in job_object["spec"]["template"]["spec"]["containers"]:
            container.setdefault("env", []).extend({"name": k, "value": v} for k, v in LIVE_JOB_ENV.items())
    return objects


def apply_then_start_the_job(kube: Kube, deadline: float, hold: GenerationHold) -> tuple[Pod, list[Pod]]:
    """Every object, the Job held until each rollout replica is ready: on a real cluster the replicas
    start at once on nodes of their own, here their vLLM start-ups share two cores, and a run of the
    tiny model can end before the second one is up. Then the replicas' generation is held (`hold`) and
    the Job starts: its run waits at its first rollouts until the test releases them. The Job's pod and
    the rollout pods."""
    kube.apply(held=lambda pod: pod.owner["kind"] == "Job")
    (job_pod,) = [p for p in kube.pods if p.owner["kind"] == "Job"]
    rollouts = [p for p in kube.pods if p.labels.get("app.kubernetes.io/component") == "rollout"]
    assert len(rollouts) == ROLLOUTS
    while not all(p.ready for p in rollouts):
        kube.check()
        assert time.monotonic() < deadline, "the rollout replicas never became ready:\n" + "\n".join(
            f"{p.name} {p.phase} ready={p.ready}\n{p.tail(1500)}" for p in rollouts)
        time.sleep(0.5)
    hold.hold([c.proc.pid for p in rollouts for c in p.containers if c.proc is not None])
    kube.release(job_pod)
    return job_pod, rollouts


def secret(namespace: str, name: str, data: dict[str, str | bytes]) -> dict:
    """As `kubectl create secret generic NAME --from-literal/--from-file` makes it."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": name, "namespace": namespace},
            "data": {k: base64.b64encode(v if isinstance(v, bytes) else v.encode()).decode() for k, v in data.items()}}


def tokens_secret(namespace: str, directory: Path) -> tuple[dict, dict[str, str]]:
    """Secret flywheel-tokens as deploy/README.md makes it, and its tokens (scope name -> token)."""
    path = directory / "tokens.yaml"
    init_tokens(path)
    tokens = {str(scope): listed[0] for scope, listed in read_tokens_file(path).items()}
    return secret(namespace, "flywheel-tokens", {"tokens.yaml": path.read_bytes()}), tokens


def bare_pod(namespace: str, name: str) -> dict:
    """As `kubectl run NAME --image=flywheel:0.1.0-cpu --labels=app=NAME -- python -m http.server 8080` makes it:
    a pod of no Flywheel workload, which no NetworkPolicy admits and none selects."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
            "spec": {"containers": [{"name": name, "image": "flywheel:0.1.0-cpu",
                                     "command": ["python", "-m", "http.server", "8080"]}]}}


def flywheel_pods(kube: Kube) -> list:
    return [p for p in kube.pods if p.labels.get("app.kubernetes.io/part-of") == "flywheel"]


def check_network_policy(kube: Kube, token: str) -> None:
    """Inside the policies, served; outside, refused (dropped: the connection times out); the same outside
    pod served by a pod no policy selects. Directly to pod IPs and through the rollouts' Service."""
    pods = {p.name: p for p in kube.pods}
    outsider, bystander = pods["outsider"], pods["bystander"]
    (controller,) = [p for p in kube.pods if p.owner["kind"] == "Job"]
    targets = {f"{p.name}:{name}": (p.ip, container_port(p, name)) for p in flywheel_pods(kube) if p is not controller
               for c in p.spec["containers"] for name in [port["name"] for port in c.get("ports", [])]}
    assert len(targets) == 2 + 2 + 3 * ROLLOUTS, targets  # synchronizer, trainer: grpc, metrics; rollouts: grpc, http, metrics
    seen = reach_all({**{("inside", target): (controller.host.netns, *address) for target, address in targets.items()},
                      **{("outside", target): (outsider.host.netns, *address) for target, address in targets.items()},
                      ("outside", "bystander"): (outsider.host.netns, bystander.ip, 8080)})
    inside = {target: seen["inside", target] for target in targets}
    outside = {target: seen["outside", target] for target in targets}
    assert inside == {target: "served" for target in targets}, inside
    assert outside == {target: "timed out" for target in targets}, outside
    assert seen["outside", "bystander"] == "served"
    status, _ = http_get_from(outsider.host.netns, f"{bystander.ip}:8080", "/", {}, timeout=10)
    assert status == 200
    # Through the Service: kube-proxy keeps the client's address, so the policy judges the client pod.
    models, auth = kube.service_address("flywheel-rollout", "http"), {"Authorization": f"Bearer {token}"}
    status, body = http_get_from(controller.host.netns, models, "/v1/models", auth, timeout=10)
    assert status == 200 and json.loads(body)["data"], body
    with pytest.raises(ConnectionError):  # the proxy's upstream connection was dropped: nothing is served
        http_get_from(outsider.host.netns, models, "/v1/models", auth, timeout=10)


def check_run_as_the_pod_user(kube: Kube) -> None:
    """Every container runs as its pod's securityContext says (runAsUser/runAsGroup 10001, fsGroup
    10001 as a supplementary group, no privilege escalation, no capabilities), and each pod's
    model-init init container wrote its models volume as that user."""
    running = {f"{p.name}/{c.name}": {**process_identity(c.proc.pid), **process_privileges(c.proc.pid)}
               for p in flywheel_pods(kube) for c in p.containers if c.proc is not None}
    assert len(running) == 3 + ROLLOUTS and running == {name: {
        "uid": 10001, "gid": 10001, "groups": (10001,), "no_new_privs": True, "bounding_set": 0} for name in running}, running
    for pod in kube.pods:
        if any(c["name"] == "model-init" for c in pod.spec.get("initContainers", [])):
            written = list((pod.home / "volumes" / "models" / "policy").rglob("*"))
            assert written and {p.stat().st_uid for p in written} == {10001}, (pod.name, written)
            # fsGroup's setgid directory: what the pod writes stays in the group.
            assert {p.stat().st_gid for p in written} == {10001}, (pod.name, written)


def start_the_job_held(kube: Kube, deadline: float, viewer_token: str, hold: GenerationHold
                       ) -> tuple[Pod, list[Pod], str, dict]:
    """Starts the job with its replicas' generation held (apply_then_start_the_job), then polls its status
    page through the controller's Service (what `kubectl port-forward svc/...` reaches) until it shows the
    trainer and every rollout live, at step 0: the job cannot end while the test looks at it, however fast
    the machine. Fails at once when a pod restarts or the controller pod ends, and at `deadline`
    (time.monotonic()). Returns the Job's pod, the rollout pods, the page and its status."""
    job_pod, rollouts = apply_then_start_the_job(kube, deadline, hold)
    page = f"http://{kube.service_address('flywheel-controller', 'http')}/"
    body, seen = {}, "the page never answered"
    while not body:
        kube.check()
        crashed = {p.name: p.why_restarted() for p in kube.pods if p.restarts}
        assert not crashed, f"restarted while the job ran: {crashed}"
        assert job_pod.phase in ("Pending", "Running"), \
            f"controller pod {job_pod.phase} while its rollouts were held ({seen}):\n{job_pod.tail()}"
        assert time.monotonic() < deadline, "the job never showed every component live:\n" + "\n".join(
            f"{p.name} {p.phase} ready={p.ready}\n{p.tail(1500)}" for p in kube.pods)
        try:
            body = live_status(page, ["rollout"] * ROLLOUTS + ["trainer"], viewer_token, steps_done=0)
        except OSError as exc:
            seen = f"the page: {exc!r}"
        time.sleep(0.5)
    return job_pod, rollouts, page, body


def start_the_job_before_its_rollouts(kube: Kube, deadline: float, viewer_token: str, tls: ssl.SSLContext
                                      ) -> tuple[Pod, list[Pod], str]:
    """Every object, the rollout replicas held: the controller's run waits for a replica to register
    (services.wait_for_rollout_seconds), so its pod is checked while it waits, however fast the machine.
    (A run of the tiny model on the transformers engine can end within 10 s, before the Job's startup
    probe first passes and its Service routes to it.) Polls the status page through the controller's
    Service (https with the client context `tls`) until it shows the trainer and no replica yet. Returns
    the Job's pod, the held rollout pods and the page."""
    kube.apply(held=lambda pod: pod.labels.get("app.kubernetes.io/component") == "rollout")
    (job_pod,) = [p for p in kube.pods if p.owner["kind"] == "Job"]
    rollouts = [p for p in kube.pods if p.labels.get("app.kubernetes.io/component") == "rollout"]
    assert len(rollouts) == ROLLOUTS
    page = f"https://{kube.service_address('flywheel-controller', 'http')}/"
    running, seen = [], "the page never answered"
    while running != ["trainer"]:
        kube.check()
        assert job_pod.phase in ("Pending", "Running"), f"controller pod {job_pod.phase} ({seen}):\n{job_pod.tail()}"
        assert time.monotonic() < deadline, f"the status page never showed the trainer ({seen}):\n" + "\n".join(
            f"{p.name} {p.phase} ready={p.ready}\n{p.tail(1500)}" for p in kube.pods)
        try:
            body = json.loads(http_get(page + "api/status", headers={"Authorization": f"Bearer {viewer_token}"},
                                       context=tls))
            running = sorted(c["role"] for c in body["components"] if c["state"] != "stopped")
            seen = f"the page lists {running}"
        except OSError as exc:
            seen = f"the page: {exc!r}"
        time.sleep(0.5)
    return job_pod, rollouts, page


def wait_until_started_and_ready(kube: Kube, pods: list[Pod], job_pod: Pod, deadline: float) -> None:
    """Until every container of `pods` passed its startup probe and, but for the Job's, its readiness
    probe; fails at once when a pod restarts."""
    def up(pod: Pod) -> bool:
        return pod.phase == "Running" and bool(pod.containers) and all(
            c.started and (c.ready or pod is job_pod) for c in pod.containers)

    while not all(up(p) for p in pods):
        kube.check()
        crashed = {p.name: p.why_restarted() for p in kube.pods if p.restarts}
        assert not crashed, f"restarted: {crashed}"
        assert time.monotonic() < deadline, [f"{p.name}/{c.name} started={c.started} ready={c.ready}"
                                             for p in pods for c in p.containers]
        time.sleep(0.5)


def wait_for_the_job_to_end(kube: Kube, job_pod: Pod, deadline: float) -> None:
    while job_pod.phase in ("Pending", "Running"):
        kube.check()
        assert time.monotonic() < deadline, f"the Job did not complete:\n{job_pod.tail()}"
        time.sleep(0.5)


def stop_keeping_the_logs(kube: Kube, cluster: NamespaceCluster) -> dict[str, str]:
    """Stops every pod and the cluster; returns each pod's last 1500 log lines, for the failures after."""
    logs = {p.name: p.tail(1500) for p in kube.pods}
    kube.stop()
    cluster.stop()
    return logs


@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
def test_kubernetes_cpu_overlay_runs_the_job_with_two_replicas(tmp_path: Path) -> None:
    objects = render(tmp_path)
    (namespace,) = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    made, tokens = tokens_secret(namespace, tmp_path)
    objects += [made, bare_pod(namespace, "outsider"), bare_pod(namespace, "bystander")]
    with NamespaceCluster(tmp_path) as cluster:
        kube = Kube(cluster, objects, tmp_path)
        deadline, hold = time.monotonic() + JOB_TIMEOUT, GenerationHold()
        try:
            # Everything below until the release looks at the job live: its replicas are held at its first rollouts.
            job_pod, rollouts, page, body = start_the_job_held(kube, deadline, tokens["viewer"], hold)
            replica_ids = sorted(c["id"] for c in body["components"] if c["role"] == "rollout")
            check_run_as_the_pod_user(kube)
            # Each rollout pod registered under its own pod IP (the Deployment's POD_IP advertise address).
            assert sorted(c["address"].rsplit(":", 1)[0] for c in body["components"] if c["role"] == "rollout") == \
                sorted(p.ip for p in rollouts), body["components"]

            # Prometheus's kubernetes-pods job: every annotated pod, at its annotated port and path.
            targets = [f"{p.ip}:{p.annotations['prometheus.io/port']}" for p in kube.pods
                       if p.annotations.get("prometheus.io/scrape") == "true"]
            assert len(targets) == 3 + ROLLOUTS
            check_dashboard(scrape(targets))
            check_page_in_browser(f"{page}#token={tokens['viewer']}", ["trainer-0", *replica_ids])
            (trainer,) = [p for p in kube.pods if p.name == "flywheel-trainer-0"]
            (synchronizer,) = [p for p in kube.pods if p.name == "flywheel-synchronizer-0"]
            check_secure_defaults(page, f"{trainer.ip}:50052", f"{synchronizer.ip}:50051", tokens)
            check_network_policy(kube, tokens["agent"])

            # Agents reach the rollouts through their Service, with the agent token (and not without one).
            models_url = f"http://{kube.service_address('flywheel-rollout', 'http')}/v1/models"
            models = json.loads(http_get(models_url, headers={"Authorization": f"Bearer {tokens['agent']}"}))
            assert models["data"], models
            with pytest.raises(urllib.error.HTTPError) as refused:
                http_get(models_url)
            assert refused.value.code == 401

            assert live_status(page, ["rollout"] * ROLLOUTS + ["trainer"], tokens["viewer"], steps_done=0), \
                "the job trained while its replicas were held: the checks above did not see it at a known step"
            hold.release()
            wait_for_the_job_to_end(kube, job_pod, deadline)
            # The replicas, still up, say themselves that they generated and moved to new weights.
            work = replica_work([f"{p.ip}:{p.annotations['prometheus.io/port']}" for p in rollouts])
        finally:
            hold.release()
            logs = stop_keeping_the_logs(kube, cluster)
        assert job_pod.phase == "Succeeded", logs[job_pod.name]
        # Probes passed for the right reasons: nothing was restarted by a probe or a crash.
        assert {p.name: p.restarts for p in kube.pods if p.restarts} == {}, logs
        run_dir = tmp_path / "claims" / "flywheel-checkpoints" / "runs" / "quickstart-tiny"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["last_step"] == LIVE_STEPS and summary["exit_code"] == 0, (summary, logs)
        newest = replica_versions((run_dir / "trained_tasks.jsonl").read_text())
        assert sorted(newest) == replica_ids, (newest, replica_ids)
        assert all(version >= 5 for version in newest.values()), newest
        assert len(work) == ROLLOUTS and all(tokens > 0 and version >= 5 for tokens, version in work.values()), work


@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
def test_kubernetes_mutual_tls_components_run_the_job_with_checkpoint_weight_sync(tmp_path: Path) -> None:
    """The job to completion under mutual TLS, its weights moved by sync.method: checkpoint: the trainer
    publishes each version to /data/published on the checkpoints claim, which the synchronizer (to verify
    it) and the rollouts (to load it) mount at the same path, their checkpoint_root."""
    from flywheel.launcher.certs import make_pki

    run = yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())
    run["sync"] = {**run.get("sync", {}), "method": "checkpoint"}
    # The engine is not this test's subject (the cpu overlay's test and compose's two-replica run keep vLLM): its
    # run file puts the rollouts on the transformers engine, as a user's would, sparing two vLLM starts.
    with_transformers_engine(run)
    objects = render(tmp_path, ("tls", "tls-mutual"), run_file=run)
    (namespace,) = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    made, tokens = tokens_secret(namespace, tmp_path)
    pki = make_pki(tmp_path / "tls", readme_cert_hosts("kubernetes"))
    objects += [made, secret(namespace, "flywheel-tls", {
        "tls.crt": pki.cert_file.read_bytes(), "tls.key": pki.key_file.read_bytes(), "ca.crt": pki.ca_file.read_bytes()})]
    client = ssl.create_default_context(cafile=pki.ca_file)
    client.load_cert_chain(pki.cert_file, pki.key_file)
    client.check_hostname = False  # the status page through its Service's virtual IP; the CA is still checked
    with NamespaceCluster(tmp_path) as cluster:
        kube = Kube(cluster, objects, tmp_path)
        deadline = time.monotonic() + JOB_TIMEOUT
        try:
            job_pod, rollouts, page = start_the_job_before_its_rollouts(kube, deadline, tokens["viewer"], client)
            # Every container passed its startup probe, and every running service pod became ready: exec
            # probes running the healthcheck script, which asks over mutual TLS.
            wait_until_started_and_ready(kube, [p for p in kube.pods if p not in rollouts], job_pod, deadline)
            assert job_pod.phase == "Running"

            (synchronizer,) = [p for p in kube.pods if p.name == "flywheel-synchronizer-0"]
            target = f"{synchronizer.ip}:50051"
            options = [("grpc.ssl_target_name_override", "flywheel-synchronizer-0.flywheel-synchronizer")]
            refused = {}
            for name, credentials in [
                ("plaintext", None),
                ("no client certificate", grpc.ssl_channel_credentials(root_certificates=pki.ca_file.read_bytes())),
            ]:
                with (grpc.insecure_channel(target) if credentials is None
                      else grpc.secure_channel(target, credentials, options=options)) as channel:
                    try:
                        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    except grpc.RpcError as exc:
                        refused[name] = exc.code()
            assert refused == {"plaintext": grpc.StatusCode.UNAVAILABLE,
                               "no client certificate": grpc.StatusCode.UNAVAILABLE}, refused
            with pytest.raises((OSError, http.client.HTTPException)):
                http_get(page.replace("https://", "http://") + "api/status")

            # Now the replicas: the run trains on them once one registers.
            for pod in rollouts:
                kube.release(pod)
            wait_until_started_and_ready(kube, rollouts, job_pod, deadline)
            models_url = f"https://{kube.service_address('flywheel-rollout', 'http')}/v1/models"
            models = json.loads(http_get(models_url, headers={"Authorization": f"Bearer {tokens['agent']}"}, context=client))
            assert models["data"], models

            wait_for_the_job_to_end(kube, job_pod, deadline)
            # Each rollout registered at its pod's DNS record (which the controller dialled over TLS: both
            # replicas' samples were trained, below), as the synchronizer still lists them.
            with grpc.secure_channel(target, grpc.ssl_channel_credentials(
                    pki.ca_file.read_bytes(), pki.key_file.read_bytes(), pki.cert_file.read_bytes()),
                    options=options) as channel:
                registry = synchronizer_pb2_grpc.SynchronizerServiceStub(channel).Status(
                    synchronizer_pb2.StatusRequest(), timeout=10,
                    metadata=[("authorization", f"Bearer {tokens['service']}")])
            registered = {c.identity.id: c.identity.address for c in registry.components
                          if c.identity.role == common_pb2.COMPONENT_ROLE_ROLLOUT}
        finally:
            logs = stop_keeping_the_logs(kube, cluster)
        assert job_pod.phase == "Succeeded", logs[job_pod.name]
        assert {p.name: p.restarts for p in kube.pods if p.restarts} == {}, logs
        claim = tmp_path / "claims" / "flywheel-checkpoints"
        run_dir = claim / "runs" / "quickstart-tiny"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["last_step"] == LIVE_STEPS and summary["exit_code"] == 0, (summary, logs)
        events = [json.loads(line) for line in (run_dir / "synchronizer_events.jsonl").read_text().splitlines() if line]
        assert {e.get("method") for e in events if e["kind"] == "VERSION_COMMITTED"} == {"CHECKPOINT"}, logs
        assert any((claim / "published").iterdir()), "no version was published to /data/published"
        assert sorted(registered.values()) == sorted(
            f"{p.ip.replace('.', '-')}.{namespace}.pod:50053" for p in rollouts), registered
        newest = replica_versions((run_dir / "trained_tasks.jsonl").read_text())
        assert set(newest) == set(registered) and all(version >= 5 for version in newest.values()), newest
