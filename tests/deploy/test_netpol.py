"""The shipped NetworkPolicies (deploy/kubernetes/base/networkpolicy.yaml) as
netpol.py turns them into nftables rules: the rules themselves, a policy field
or value nobody enforces refused, and the rules enforced by the kernel in
network namespaces (a few sockets, no services: seconds). The whole overlay
running under them is test_kubernetes_cluster.py's."""

from __future__ import annotations

import copy
import shutil
import socket

import pytest

from tests.deploy.cluster import NamespaceCluster, available, socket_in
from tests.deploy.kube import Kube
from tests.deploy.manifests import render_overlay, workloads
from tests.deploy.netpol import Member, apply_ruleset, ingress_ruleset, ingress_rulesets, reach_all

NODE = "10.9.0.1"
OUTSIDER = {"app": "outsider"}


@pytest.fixture(scope="module")
def cpu_objects():
    return render_overlay("cpu")


def members_of(objects: list[dict], outsider_ip: str = "10.9.0.99") -> list[Member]:
    """One pod per workload of the overlay (10.9.0.10 up), and a pod of no Flywheel workload."""
    found = []
    for index, workload in enumerate(workloads(objects)):
        template = workload["spec"]["template"]
        ports = {p["name"]: (p["containerPort"], "TCP") for c in template["spec"]["containers"] for p in c["ports"]}
        found.append(Member(workload["metadata"]["name"], f"10.9.0.{10 + index}", "flywheel",
                            template["metadata"]["labels"], ports))
    return [*found, Member("outsider", outsider_ip, "flywheel", OUTSIDER)]


def policies(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def test_every_flywheel_pod_admits_only_the_project_on_its_service_ports(cpu_objects):
    members = members_of(cpu_objects)
    ip = {m.name: m.ip for m in members}
    project = "10.9.0.10, 10.9.0.11, 10.9.0.12, 10.9.0.13"  # rollout, synchronizer, trainer, controller
    rules = ingress_rulesets(policies(cpu_objects), members, {"flywheel": {}}, node=[NODE])
    assert rules["outsider"] is None  # selected by no policy: not isolated
    trainer = rules["flywheel-trainer"].splitlines()
    assert trainer[:3] == ["table inet flywheel_policy {", "\tchain input {",
                           "\t\ttype filter hook input priority filter; policy drop;"]
    assert [line.strip() for line in trainer[3:-2]] == [
        "ct state established,related accept", 'iifname "lo" accept', f'ip saddr {NODE} accept comment "the node"',
        # service ports: the trainer names no `http` port, so only grpc and metrics are open to it
        f'ip saddr {{ {project} }} meta l4proto tcp th dport {{ 50052, 9092 }} accept '
        'comment "flywheel-service-ports ingress[0]"',
        # weight transfers: any port, from trainer and rollouts only
        f'ip saddr {{ {ip["flywheel-rollout"]}, {ip["flywheel-trainer"]} }} accept '
        'comment "flywheel-weight-transfers ingress[0]"',
    ]
    assert 'dport { 50053, 8000, 9093 } accept comment "flywheel-service-ports' in rules["flywheel-rollout"]
    assert "weight-transfers" in rules["flywheel-rollout"]
    for name, ports in (("flywheel-synchronizer", "50051, 9091"), ("flywheel-controller", "50054, 8080, 9094")):
        assert f"{{ {project} }} meta l4proto tcp th dport {{ {ports} }} accept" in rules[name], rules[name]
        assert "weight-transfers" not in rules[name]  # selected by the service-ports policy only
    assert all(ip["outsider"] not in text for text in rules.values() if text)


def test_the_remote_site_admits_the_central_range_on_grpc_only():
    objects = render_overlay("remote-site")
    rollout = next(w for w in workloads(objects) if w["metadata"]["name"] == "flywheel-rollout")
    member = Member("rollout", "10.9.0.10", "flywheel", rollout["spec"]["template"]["metadata"]["labels"],
                    {"grpc": (50053, "TCP"), "http": (8000, "TCP")})
    text = ingress_ruleset(member, policies(objects), [member], {"flywheel": {}}, node=[NODE])
    assert 'ip saddr 192.0.2.0/24 meta l4proto tcp th dport { 50053 } accept comment "flywheel-central-site' in text


def test_ports_protocols_ranges_and_ip_blocks_translate_as_kubernetes_reads_them():
    policy = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"podSelector": {}, "ingress": [
        {"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
                  {"namespaceSelector": {"matchLabels": {"team": "a"}}, "podSelector": {"matchExpressions": [
                      {"key": "role", "operator": "Exists"}]}}],
         "ports": [{"port": 7000, "endPort": 7010}, {"port": "dns", "protocol": "UDP"}, {"port": "absent"}]},
        {},  # an empty rule: everything
    ]}}
    target = Member("t", "10.9.0.10", "ns", {}, {"dns": (53, "UDP")})
    other = Member("o", "10.9.0.11", "other", {"role": "x"})
    text = ingress_ruleset(target, [policy], [target, other], {"ns": {}, "other": {"team": "a"}}, node=[NODE])
    rules = [line.strip() for line in text.splitlines() if 'comment "p ' in line]
    assert rules == [
        'ip saddr 10.0.0.0/8 ip saddr != { 10.1.0.0/16 } meta l4proto tcp th dport { 7000-7010 } accept '
        'comment "p ingress[0]"',
        'ip saddr 10.0.0.0/8 ip saddr != { 10.1.0.0/16 } meta l4proto udp th dport { 53 } accept comment "p ingress[0]"',
        'ip saddr { 10.9.0.11 } meta l4proto tcp th dport { 7000-7010 } accept comment "p ingress[0]"',
        'ip saddr { 10.9.0.11 } meta l4proto udp th dport { 53 } accept comment "p ingress[0]"',
        'accept comment "p ingress[1]"',
    ]
    denied = copy.deepcopy(policy)
    denied["spec"]["ingress"] = []  # isolated, nothing admitted but the node
    assert 'comment "p' not in ingress_ruleset(target, [denied], [target], {"ns": {}}, node=[NODE])


@pytest.mark.parametrize("change, refused", [
    (lambda spec: spec.update(policyTypes=["Ingress", "Egress"], egress=[{}]), "field spec.egress"),
    (lambda spec: spec.update(policyTypes=["Ingress", "Egress"]), "only Ingress is enforced"),
    (lambda spec: spec["ingress"][0]["from"][0]["podSelector"].update(matchFields=[]),
     "field spec.ingress[0].from[0].podSelector.matchFields"),
    (lambda spec: spec["ingress"][0]["ports"][0].update(protocol="ICMP"), "protocol ICMP"),
    (lambda spec: spec["podSelector"].update(matchExpressions=[{"key": "a", "operator": "Gt", "values": ["1"]}]),
     "selector operator Gt"),
])
def test_a_policy_field_or_value_nobody_enforces_is_refused(tmp_path, cpu_objects, change, refused):
    objects = copy.deepcopy(cpu_objects)
    (policy,) = [o for o in objects if o["metadata"]["name"] == "flywheel-service-ports"]
    change(policy["spec"])
    with pytest.raises(AssertionError, match="NetworkPolicy/flywheel-service-ports: .*" + refused.replace("[", r"\[")):
        Kube(None, objects, tmp_path)


WHY_NOT = available()  # without nft the kernel check fails, naming it (.ci/run installs nftables)


def listen_in(netns: str, address: str, port: int) -> socket.socket:
    listener = socket_in(netns)
    listener.bind((address, port))
    listener.listen(8)  # the kernel completes handshakes without accept()
    return listener


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
def test_the_kernel_enforces_the_shipped_policies_between_namespaces(tmp_path, cpu_objects):
    assert shutil.which("nft"), "nft not found (Debian: nftables; .ci/run installs it): policies cannot be enforced"
    with NamespaceCluster(tmp_path) as cluster:
        hosts = {name: cluster.add_host(name, names=[]) for name in ("trainer", "rollout", "controller", "outsider",
                                                                     "bystander")}
        by_name = {m.name.removeprefix("flywheel-"): m for m in members_of(cpu_objects)}
        members = []
        for name, host in hosts.items():
            member = by_name[name] if name in by_name else Member(name, host.address, "flywheel", OUTSIDER)
            members.append(Member(name, host.address, "flywheel", member.labels, member.ports))
        rules = ingress_rulesets(policies(cpu_objects), members, {"flywheel": {}}, node=[cluster.gateway])
        for name, host in hosts.items():
            apply_ruleset(host.netns, rules[name])
        trainer, outsider, bystander = hosts["trainer"], hosts["outsider"], hosts["bystander"]
        ports = {"grpc": 50052, "metrics": 9092, "rendezvous": 29600}
        listeners = [listen_in(trainer.netns, trainer.address, p) for p in ports.values()]
        listeners.append(listen_in(bystander.netns, bystander.address, 8080))
        try:
            seen = reach_all({
                **{(source, port): (hosts[source].netns if source != "node" else None, trainer.address, number)
                   for source in ("controller", "rollout", "outsider", "node") for port, number in ports.items()},
                ("outsider", "bystander"): (outsider.netns, bystander.address, 8080)})
        finally:
            for listener in listeners:
                listener.close()
    assert seen == {
        # the project's pods on the service ports; weight transfers from the rollouts only
        ("controller", "grpc"): "served", ("controller", "metrics"): "served", ("controller", "rendezvous"): "timed out",
        ("rollout", "grpc"): "served", ("rollout", "metrics"): "served", ("rollout", "rendezvous"): "served",
        # a pod outside the policies: dropped everywhere on the trainer...
        ("outsider", "grpc"): "timed out", ("outsider", "metrics"): "timed out", ("outsider", "rendezvous"): "timed out",
        # ...while the same pod is served by a pod no policy selects: the policy refused it, not the network
        ("outsider", "bystander"): "served",
        # the node (the kubelet's probes) always
        ("node", "grpc"): "served", ("node", "metrics"): "served", ("node", "rendezvous"): "served",
    }
