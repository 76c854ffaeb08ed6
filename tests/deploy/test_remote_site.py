"""A far site's deployment, resolved through the services' own config code: a relay of the run's
synchronizer and replicas that pull through it. deploy/compose/docker-compose.remote-site.yml read the
way `docker compose -f docker-compose.yml -f <it>` reads it (only under the remote-site profile), and
deploy/kubernetes/overlays/remote-site as `kubectl kustomize` renders it (nothing of the central site)."""

from __future__ import annotations

import ipaddress

import pytest

from tests.deploy.manifests import (
    ROOT, compose_containers, compose_mounts, k8s_containers, k8s_mounts, load_compose, render_overlay, resolved,
    selects,
)

OVERRIDE = ROOT / "deploy" / "compose" / "docker-compose.remote-site.yml"
VARIABLES = {"FLYWHEEL_UPSTREAM": "central.example:50051", "FLYWHEEL_SITE": "eu-west",
             "FLYWHEEL_ROLLOUT_ADDRESS": "far-host.example:50053"}


def _remote_site():
    containers = {c.name: c for c in compose_containers(load_compose(VARIABLES, overrides=(OVERRIDE,)))}
    return containers["relay"], containers["rollout-remote"]


def test_the_relay_relays_the_run_synchronizer_for_its_site_and_is_reached_where_it_says():
    relay, replica = _remote_site()
    config = resolved(relay)
    assert config.relay is not None
    assert (config.relay.upstream, config.relay.site) == ("central.example:50051", "eu-west")
    assert config.shared_memory_dir == ""  # its readers are other containers
    host, port = config.relay.advertise_address.rsplit(":", 1)
    assert host == relay.name and int(port) == config.server.port
    assert relay.raw["healthcheck"]["test"][-1] == f"127.0.0.1:{config.server.port}"


def test_the_far_replica_registers_with_the_run_synchronizer_and_pulls_through_its_sites_relay():
    relay, replica = _remote_site()
    config = resolved(replica)
    assert config.synchronizer.address == "central.example:50051"
    assert config.synchronizer.site == resolved(relay).relay.site
    assert config.synchronizer.advertise_address == "far-host.example:50053"
    assert config.updates.delta_pulls in ("auto", "on")
    assert replica.raw["depends_on"]["relay"]["condition"] == "service_healthy"
    assert all(str(path) != "/weights-shm" for path in compose_mounts(replica))  # no shared memory across the link


def test_the_remote_site_starts_only_under_its_profile():
    for c in _remote_site():
        assert c.raw["profiles"] == ["remote-site"], c.source


# ---------------------------------------------------------------- Kubernetes


def _matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a pod's labels."""
    expressions = {"In": lambda k, vs: labels.get(k) in vs, "NotIn": lambda k, vs: labels.get(k) not in vs,
                   "Exists": lambda k, vs: k in labels, "DoesNotExist": lambda k, vs: k not in labels}
    return selects(selector.get("matchLabels", {}), labels) and all(
        expressions[e["operator"]](e["key"], e.get("values", [])) for e in selector.get("matchExpressions", []))


@pytest.fixture(scope="module")
def remote_site_objects():
    return render_overlay("remote-site")


def _k8s_remote_site(objects):
    containers = {c.name: c for c in k8s_containers("remote-site", objects)}
    assert set(containers) == {"relay", "rollout"}, "a far site runs only its relay and its replicas"
    return containers["relay"], containers["rollout"]


def test_the_kubernetes_site_runs_no_trainer_synchronizer_controller_or_checkpoint_volume(remote_site_objects):
    names = {(o["kind"], o["metadata"]["name"]) for o in remote_site_objects}
    for central in ("flywheel-trainer", "flywheel-synchronizer", "flywheel-controller", "flywheel-checkpoints"):
        assert not any(name == central for _, name in names), central
    assert all(o["metadata"].get("namespace") == "flywheel" for o in remote_site_objects if o["kind"] != "Namespace")


def test_the_kubernetes_relay_and_replicas_name_the_same_upstream_and_site(remote_site_objects):
    relay, replica = _k8s_remote_site(remote_site_objects)
    relay_config, replica_config = resolved(relay), resolved(replica)
    assert relay_config.relay is not None and relay_config.shared_memory_dir == ""
    assert replica_config.synchronizer.address == relay_config.relay.upstream
    assert replica_config.synchronizer.site == relay_config.relay.site
    assert replica_config.updates.delta_pulls in ("auto", "on")
    # Replicas reach the relay where it advertises itself: its Service, on its gRPC port.
    host, port = relay_config.relay.advertise_address.rsplit(":", 1)
    service = next(o for o in remote_site_objects if o["kind"] == "Service" and o["metadata"]["name"] == host)
    assert selects(service["spec"]["selector"], relay.pod["metadata"]["labels"])
    assert [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"] == [int(port)]
    assert relay.raw["ports"][0]["containerPort"] == relay_config.server.port == int(port)
    # The checkpoint volume is the central cluster's: the replicas neither mount nor declare it.
    assert all(m["volume"]["name"] != "data" for m in k8s_mounts(replica).values())
    assert "data" not in {v["name"] for v in replica.pod["spec"]["volumes"]}


def test_the_kubernetes_site_admits_its_replicas_to_the_relay_and_the_central_controller_to_them(
    remote_site_objects,
):
    relay, replica = _k8s_remote_site(remote_site_objects)
    policies = [o for o in remote_site_objects if o["kind"] == "NetworkPolicy"]

    def admitted(target, source_labels=None, address=None) -> set:
        ports = set()
        for policy in policies:
            if not _matches(policy["spec"]["podSelector"], target.pod["metadata"]["labels"]):
                continue
            for rule in policy["spec"].get("ingress", []):
                for peer in rule.get("from", []):
                    by_pod = source_labels is not None and "podSelector" in peer and _matches(
                        peer["podSelector"], source_labels)
                    by_address = address is not None and "ipBlock" in peer and ipaddress.ip_address(address) in \
                        ipaddress.ip_network(peer["ipBlock"]["cidr"])
                    if by_pod or by_address:
                        ports |= {p["port"] for p in rule.get("ports", [])}
        return ports

    assert "grpc" in admitted(relay, source_labels=replica.pod["metadata"]["labels"])
    central = next(p for p in policies if p["metadata"]["name"] == "flywheel-central-site")
    placeholder = central["spec"]["ingress"][0]["from"][0]["ipBlock"]["cidr"]
    assert admitted(replica, address=str(ipaddress.ip_network(placeholder)[1])) == {"grpc"}
    assert admitted(replica, address="203.0.113.9") == set()  # anyone else: nothing
