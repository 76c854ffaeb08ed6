"""Who reaches whom in every deployment: the run the controller executes (its file,
then FLYWHEEL_RUN__* variables) names services that exist on the right ports; trainer
and rollouts start from the same run file; every address a service is given reaches
the right service; GPU deployments move weights by NCCL with the trainer's DNS name as
the rendezvous. All checked on the files as written (compose interpolated, overlays
rendered), through the services' own config and run-config code.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import PurePosixPath
from typing import Any

import pytest

from flywheel.runtime.config import leaf_fields
from tests.deploy.manifests import (
    JOB_OVERLAYS,
    ROOT,
    Container,
    compose_mounts,
    compose_names,
    default_profiles,
    expected_ports,
    image_files,
    k8s_mounts,
    resolved,
    run_config,
    selects,
    workloads,
)


def test_controller_arguments_name_a_mounted_run_config(k8s, composed):
    for c in [*k8s, *composed]:
        if c.service != "controller":
            continue
        assert c.args[:1] == ["run"] and len(c.args) == 2, f"{c.source}: expected `run CONFIG`, got {c.args}"
        mounts = k8s_mounts(c) if c.pod else compose_mounts(c)
        assert any(PurePosixPath(c.args[1]).is_relative_to(m) for m in [*mounts, *image_files()]), (
            f"{c.source}: {c.args[1]} is neither mounted nor in the image"
        )


def test_compose_controller_runs_against_the_compose_services(composed, compose):
    names = compose_names(compose)
    for controller in [c for c in composed if c.service == "controller"]:
        services = run_config(controller, None).services
        for role, endpoint in [("synchronizer", services.synchronizer), ("trainer", services.trainer),
                               *(("rollout", r) for r in services.rollout)]:
            host, port = endpoint.address.rsplit(":", 1)
            assert host in names, f"{controller.source}: {role} address {endpoint.address} names no compose service"
            ports = {expected_ports(c)["grpc"] for c in composed if c.name in names[host] and c.service == role}
            assert ports == {int(port)}, f"{controller.source}: {role} at {endpoint.address}, listening on {ports}"


@pytest.mark.parametrize("overlay", JOB_OVERLAYS)
def test_kubernetes_controller_runs_against_the_cluster_services(rendered, k8s, overlay):
    objects = rendered[overlay]
    (controller,) = [c for c in k8s if c.service == "controller" and c.source.startswith(f"kubernetes/{overlay} ")]
    services = run_config(controller, objects).services
    k8s_services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for role, endpoint in [("synchronizer", services.synchronizer), ("trainer", services.trainer),
                           *(("rollout", r) for r in services.rollout)]:
        host, port = endpoint.address.rsplit(":", 1)
        # "<pod>.<headless service>" (a StatefulSet member) or "<service>".
        svc_name = host.split(".")[1] if "." in host else host
        assert svc_name in k8s_services, f"{overlay}: {role} address {endpoint.address} names no Service"
        svc = k8s_services[svc_name]
        workload = [w for w in workloads(objects)
                    if selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])][0]
        if "." in host:
            assert workload["kind"] == "StatefulSet" and host.split(".")[0].rsplit("-", 1)[0] == workload["metadata"]["name"]
        served = [c for c in k8s if c.source == f"kubernetes/{overlay} {workload['kind']}/{workload['metadata']['name']}"]
        assert [c.service for c in served] == [role], f"{overlay}: {endpoint.address} reaches {served}"
        assert {p["port"] for p in svc["spec"]["ports"]} >= {int(port)} == {expected_ports(served[0])["grpc"]}, (
            f"{overlay}: {role} at {endpoint.address}"
        )


def test_controller_cli_accepts_run_when_it_exists():
    help_text = subprocess.run(
        [sys.executable, "-m", "services.controller", "--help"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    ).stdout
    assert re.search(r"\brun\b", help_text.split("options:")[0]), "services.controller has no `run` subcommand"
    done = subprocess.run(
        [sys.executable, "-m", "services.controller", "run", "--help"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("overlay", JOB_OVERLAYS)
def test_controller_trainer_and_rollout_take_the_same_run_file(rendered, k8s, overlay):
    """The Job runs the file whose launch.<service> sections trainer and rollouts start from."""
    deployed = [c for c in k8s if c.source.startswith(f"kubernetes/{overlay} ")]
    (controller,) = [c for c in deployed if c.service == "controller"]
    run_file = controller.args[1]
    for c in deployed:
        if c.service in ("trainer", "rollout"):
            assert c.args == ["--run-file", run_file], c.source
    assert run_config(controller, rendered[overlay]).run.max_steps >= 1


DEPLOYMENTS = [("compose", "cpu"), ("compose", "gpu"), ("kubernetes", "cpu"), ("kubernetes", "gpu")]


def _deployment(kind: str, variant: str, composed, k8s, rendered, compose) -> dict[str, Container]:
    """service -> the one container of that deployment running it."""
    if kind == "compose":
        active = default_profiles() if variant == "cpu" else {variant}
        chosen = [c for c in composed if not c.raw.get("profiles") or set(c.raw["profiles"]) & active]
    else:
        chosen = [c for c in k8s if c.source.startswith(f"kubernetes/{variant} ")]
    return {c.service: c for c in chosen}


@pytest.mark.parametrize(("kind", "variant"), DEPLOYMENTS, ids=[f"{k}-{v}" for k, v in DEPLOYMENTS])
def test_gpu_deployments_move_weights_by_nccl_rendezvousing_at_the_trainers_dns_name(
    kind, variant, composed, k8s, rendered, compose
):
    """What the synchronizer does with the rendered config: the controller's run sets the sync
    method; `group_backend: auto` picks nccl when every member registered a CUDA device (the trainer
    its model.device, a rollout "cuda" when its engine is vLLM); the group's rendezvous is the
    trainer's advertised host (rendezvous_host empty), which must reach the trainer's pod or container."""
    deployed = _deployment(kind, variant, composed, k8s, rendered, compose)
    run = run_config(deployed["controller"], rendered.get(variant) if kind == "kubernetes" else None)
    trainer, rollout, synchronizer = (resolved(deployed[s]) for s in ("trainer", "rollout", "synchronizer"))
    if variant == "cpu":
        assert run.sync.method == "memory", f"{kind}/{variant}: CPU deployments move weights through the synchronizer"
        return
    assert run.sync.method == "nccl", f"{kind}/{variant}: the run's sync.method is {run.sync.method}"
    assert trainer.model.device.startswith("cuda"), f"{kind}/{variant}: trainer on {trainer.model.device}"
    assert rollout.engine.kind == "vllm", f"{kind}/{variant}: rollout engine {rollout.engine.kind} registers a CPU"
    assert synchronizer.group_backend in ("auto", "nccl"), synchronizer.group_backend
    assert synchronizer.rendezvous_host == "", "a fixed rendezvous host would bypass the trainer's DNS name"
    host = trainer.sync.advertise_address.rsplit(":", 1)[0]
    if kind == "compose":
        answering = compose_names(compose).get(host, set())
        assert deployed["trainer"].name in answering, f"compose/gpu: rendezvous host {host!r} is not the trainer"
    else:
        objects = rendered[variant]
        pod, _, service_name = host.partition(".")
        (svc,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == service_name]
        (sts,) = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == pod.rsplit("-", 1)[0]]
        assert svc["spec"].get("clusterIP") == "None", f"{service_name} must be headless: {host} names a pod"
        assert sts["spec"]["serviceName"] == service_name and pod.rsplit("-", 1)[1] == "0"
        assert selects(svc["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
        assert [c.service for c in k8s if c.source == f"kubernetes/{variant} StatefulSet/{sts['metadata']['name']}"] == ["trainer"]
        # The rendezvous resolves while the group forms, before the trainer reports ready.
        assert svc["spec"].get("publishNotReadyAddresses") is True


def _address_fields(config: Any) -> list[tuple[str, str]]:
    """(field path, "host:port") of every configured *address field of a service config."""
    found = []
    for path in leaf_fields(type(config)):
        if not path[-1].endswith("address"):
            continue
        value: Any = config
        for part in path:
            value = getattr(value, part) if value is not None else None  # an unset section (relay) has none
        if value:
            found.append((".".join(path), value))
    return found


@pytest.mark.parametrize(("kind", "variant"), DEPLOYMENTS, ids=[f"{k}-{v}" for k, v in DEPLOYMENTS])
def test_every_address_a_service_is_given_reaches_the_right_service_and_port(
    kind, variant, composed, k8s, rendered, compose
):
    """synchronizer addresses name the synchronizer's gRPC port; advertise addresses the container itself."""
    deployed = _deployment(kind, variant, composed, k8s, rendered, compose)
    for c in deployed.values():
        for path, address in _address_fields(resolved(c)):
            host, _, port = address.rpartition(":")
            role = c.service if "advertise" in path else "synchronizer" if "synchronizer" in path else c.service
            if kind == "compose":
                names = compose_names(compose).get(host, set())
                targets = [t for t in deployed.values() if t.name in names]
            elif host == "$(POD_IP)":  # the downward API: the pod's own IP
                targets = [c]
            else:
                objects = rendered[variant]
                pod, _, service_name = host.rpartition(".")
                svcs = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == service_name]
                chosen = [w for w in workloads(objects) for s in svcs
                             if selects(s["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
                             and (not pod or (w["kind"] == "StatefulSet" and pod == f"{w['metadata']['name']}-0"))]
                sources = {f"kubernetes/{variant} {w['kind']}/{w['metadata']['name']}" for w in chosen}
                targets = [t for t in deployed.values() if t.source in sources]
            assert [t.service for t in targets] == [role], (
                f"{c.source}: {path} = {address} reaches {[t.source for t in targets]}, not the {role}")
            assert int(port) == expected_ports(targets[0])["grpc"], f"{c.source}: {path} = {address}"


def _inside(path: object, root: object) -> bool:
    return PurePosixPath(str(path)).is_relative_to(PurePosixPath(str(root)))


def _check_tinker_gateway(gateway: Container, served: dict[str, Container], where: str) -> None:
    """What the gateway needs of the trainer and rollout its addresses reach: their gRPC ports, a trainer
    that trains LoRA adapters, named saves inside the trainer's checkpoint.dir, and sampler versions
    inside what the trainer may write and the rollout may load (its checkpoint_root)."""
    config = resolved(gateway)
    trainer, rollout = resolved(served["trainer"]), resolved(served["rollout"])
    for role, address in (("trainer", config.trainer_address), ("rollout", config.rollout_address)):
        assert int(address.rsplit(":", 1)[1]) == expected_ports(served[role])["grpc"], f"{where}: {role} {address}"
    assert trainer.model.lora.enabled and "lm_head" in trainer.model.lora.target_modules, where
    assert trainer.model.path == rollout.engine.model_path and str(trainer.model.path).endswith("-untied"), where
    assert _inside(config.checkpoint_dir, trainer.checkpoint.dir), f"{where}: {config.checkpoint_dir}"
    assert _inside(config.sampler_dir, trainer.sync.publish_dir), f"{where}: {config.sampler_dir}"
    assert _inside(config.sampler_dir, rollout.updates.checkpoint_root), f"{where}: {config.sampler_dir}"
    assert not rollout.synchronizer.address, f"{where}: the gateway's replica must take no run's updates"
    assert not trainer.sync.synchronizer_address, f"{where}: the gateway's trainer must publish to no run"


def test_the_compose_tinker_gateway_reaches_its_own_trainer_and_rollout(composed, compose):
    names = compose_names(compose)
    (gateway,) = [c for c in composed if c.service == "tinker"]
    served = {}
    for role, address in (("trainer", resolved(gateway).trainer_address),
                          ("rollout", resolved(gateway).rollout_address)):
        host = address.rsplit(":", 1)[0]
        # In the tinker profile, the name reaches the profile's own trainer and rollout.
        (served[role],) = [c for c in composed if c.name in names.get(host, ()) and "tinker" in c.raw.get("profiles", ())]
    _check_tinker_gateway(gateway, served, "compose")


def test_the_kubernetes_tinker_gateway_reaches_its_own_trainer_and_rollout(rendered, k8s):
    objects = rendered["tinker"]
    deployed = [c for c in k8s if c.source.startswith("kubernetes/tinker ")]
    (gateway,) = [c for c in deployed if c.service == "tinker"]
    served = {c.service: c for c in deployed if c.service in ("trainer", "rollout")}
    _check_tinker_gateway(gateway, served, "kubernetes/tinker")
    (replicas,) = [w["spec"]["replicas"] for w in workloads(objects) if w["metadata"]["name"] == "flywheel-rollout"]
    assert replicas == 1, "the gateway installs versions on one replica"
