"""NetworkPolicies enforced on a namespace cluster (cluster.py, kube.py) with the
kernel's packet filter, as a policy-enforcing network plugin (Calico, Cilium)
enforces them.

    rulesets = ingress_rulesets(policies, members, namespaces, node=[cluster.gateway])
    for member in members:
        apply_ruleset(netns_of(member), rulesets[member.name])

Each pod selected by a policy with policyTypes Ingress gets an nftables table
in its own network namespace (`inet flywheel_policy`, its input hook, policy
drop), which admits:
- replies to connections the pod made itself (conntrack established/related),
  and its own loopback;
- the node: "the only allowed connections into the pod are those from the
  pod's node and those allowed by the ingress rule list of some NetworkPolicy
  that applies to the pod" (Kubernetes, Network Policies). The kubelet's
  probes and the test itself connect from the root namespace, the node here;
- what an ingress rule of a policy selecting it admits: the sources of its
  `from` (podSelector and namespaceSelector as the pods' IPs, ipBlock as its
  CIDR less its `except`; no `from`, any source) to its `ports` (a number,
  a range with endPort, or a name looked up among the destination pod's
  container ports; TCP unless protocol says UDP or SCTP; no `ports`, any).
Everything else is dropped, as those plugins drop it: the client's connection
times out. Pods no policy selects get no table and admit everything. The rules
name pods by IP, so kube.py writes them once every pod has its address and
before any container starts (Kube.enforce() rewrites them all).

Services: kube.py's ClusterIP proxy is a userspace one in the root namespace,
where a real kube-proxy DNATs in the kernel and leaves the client's source
address on the packet, so the destination's policy judges the client pod. To
keep that, the proxy opens its upstream connection from inside the client's
network namespace (cluster.socket_in), so the packet reaches the endpoint from
the client pod's own IP and the same rules judge it; a client that is not a
pod (the node) connects from the node. One difference remains: the proxy has
already accepted the client's connection when the upstream one is dropped, so
such a client sees its connection closed (after the proxy's connect timeout)
rather than its own SYN going unanswered. Either way nothing is served.

Not enforced, and refused where a policy asks for it (fields.py names the
fields played, check_policy the values): Egress policies (the shipped ones are
Ingress only), and anything else a policy may say that is not listed above.
One namespace only: a namespaceSelector matches against the Namespace
objects' labels (plus kubernetes.io/metadata.name), and only pods of the
rendered namespace exist.
"""

from __future__ import annotations

import http.client
import ipaddress
import subprocess
from collections.abc import Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tests.deploy.cluster import connect_from
from tests.deploy.fields import check_network_policy

TABLE = "flywheel_policy"
PROTOCOLS = ("TCP", "UDP", "SCTP")
OPERATORS = {
    "In": lambda labels, key, values: labels.get(key) in values,
    "NotIn": lambda labels, key, values: labels.get(key) not in values,
    "Exists": lambda labels, key, values: key in labels,
    "DoesNotExist": lambda labels, key, values: key not in labels,
}


@dataclass
class Member:
    """A pod as policies see it: where it is, what it is labelled, which ports it names."""
    name: str
    ip: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, tuple[int, str]] = field(default_factory=dict)  # container port name -> (number, protocol)


def check_policy(policy: dict[str, Any], owner: str) -> None:
    """Refuses what this module does not enforce: fields (fields.py) and values (policy types,
    selector operators, protocols), naming them, so a policy is never passed unenforced."""
    check_network_policy(policy["spec"], owner)
    types = policy_types(policy)
    assert set(types) <= {"Ingress"}, (
        f"{owner}: policyTypes {types}: only Ingress is enforced by the deployment harness (tests/deploy/netpol.py)")
    spec = policy["spec"]
    selectors = [spec.get("podSelector") or {}] + [
        peer[key] for rule in spec.get("ingress") or [] for peer in rule.get("from") or []
        for key in ("podSelector", "namespaceSelector") if key in peer]
    for selector in selectors:
        for expression in selector.get("matchExpressions") or []:
            assert expression["operator"] in OPERATORS, f"{owner}: selector operator {expression['operator']}"
    for rule in spec.get("ingress") or []:
        for port in rule.get("ports") or []:
            assert port.get("protocol", "TCP") in PROTOCOLS, f"{owner}: protocol {port['protocol']}"
            assert "endPort" not in port or isinstance(port.get("port"), int), f"{owner}: endPort needs a numeric port"


def policy_types(policy: dict[str, Any]) -> list[str]:
    """As the apiserver defaults them: Ingress always, Egress where the policy has egress rules."""
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions); the empty selector matches everything."""
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()) and all(
        OPERATORS[e["operator"]](labels, e["key"], e.get("values") or [])
        for e in selector.get("matchExpressions") or [])


def _sources(peers: list[dict[str, Any]] | None, policy_namespace: str, members: list[Member],
             namespaces: dict[str, dict[str, str]]) -> list[str] | None:
    """nft source conditions for a rule's `from`: None for any source, [] when it names nobody."""
    if not peers:
        return None
    conditions = []
    for peer in peers:
        if "ipBlock" in peer:
            block = ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False)
            family = "ip" if block.version == 4 else "ip6"
            condition = f"{family} saddr {block}"
            if peer["ipBlock"].get("except"):
                condition += f" {family} saddr != {{ {', '.join(peer['ipBlock']['except'])} }}"
            conditions.append(condition)
            continue
        if "namespaceSelector" in peer:
            chosen = {name for name, labels in namespaces.items()
                      if matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": name, **labels})}
        else:
            chosen = {policy_namespace}
        addresses = sorted({m.ip for m in members if m.namespace in chosen
                            and matches(peer.get("podSelector") or {}, m.labels)}, key=ipaddress.ip_address)
        if addresses:
            conditions.append(f"ip saddr {{ {', '.join(addresses)} }}")
    return conditions


def _ports(ports: list[dict[str, Any]] | None, target: Member) -> list[str] | None:
    """nft port conditions for a rule's `ports` on `target`: None for any, [] when none exists on it."""
    if not ports:
        return None
    by_protocol: dict[str, list[str]] = {}
    for entry in ports:
        protocol, port = entry.get("protocol", "TCP"), entry.get("port")
        if port is None:
            by_protocol[protocol] = []  # every port of this protocol
            continue
        if isinstance(port, str) and not port.isdigit():
            if port not in target.ports or target.ports[port][1] != protocol:
                continue  # the pod has no such named port: this entry admits nothing to it
            port = target.ports[port][0]
        numbers = f"{port}-{entry['endPort']}" if "endPort" in entry else str(port)
        if by_protocol.get(protocol) != []:
            by_protocol.setdefault(protocol, []).append(numbers)
    return [f"meta l4proto {p.lower()}" + (f" th dport {{ {', '.join(n)} }}" if n else "")
            for p, n in by_protocol.items()]


def ingress_ruleset(target: Member, policies: list[dict[str, Any]], members: list[Member],
                    namespaces: dict[str, dict[str, str]], node: list[str]) -> str | None:
    """The nftables table that isolates `target` for ingress, or None where no policy selects it."""
    selecting = [p for p in policies if p["metadata"].get("namespace", target.namespace) == target.namespace
                 and "Ingress" in policy_types(p) and matches(p["spec"].get("podSelector") or {}, target.labels)]
    if not selecting:
        return None
    lines = ["ct state established,related accept", 'iifname "lo" accept',
             *(f'ip saddr {address} accept comment "the node"' for address in node)]
    for policy in selecting:
        namespace = policy["metadata"].get("namespace", target.namespace)
        for index, rule in enumerate(policy["spec"].get("ingress") or []):
            sources = _sources(rule.get("from"), namespace, members, namespaces)
            ports = _ports(rule.get("ports"), target)
            comment = f'comment "{policy["metadata"]["name"]} ingress[{index}]"'
            for source in [""] if sources is None else sources:
                for port in [""] if ports is None else ports:
                    lines.append(" ".join(part for part in (source, port, "accept", comment) if part))
    body = "\n".join(f"\t\t{line}" for line in lines)
    return (f"table inet {TABLE} {{\n\tchain input {{\n\t\ttype filter hook input priority filter; policy drop;\n"
            f"{body}\n\t}}\n}}\n")


def ingress_rulesets(policies: list[dict[str, Any]], members: list[Member], namespaces: dict[str, dict[str, str]],
                     node: list[str]) -> dict[str, str | None]:
    """Every member's table (None: not isolated), by member name."""
    return {m.name: ingress_ruleset(m, policies, members, namespaces, node) for m in members}


def apply_ruleset(netns: str, ruleset: str | None) -> None:
    """Replaces the policy table in a network namespace at once (one nft transaction); None removes it."""
    script = f"table inet {TABLE}\ndelete table inet {TABLE}\n" + (ruleset or "")
    subprocess.run(["nsenter", f"--net=/var/run/netns/{netns}", "nft", "-f", "-"], input=script, text=True,
                   check=True, capture_output=True)


# -- what a client sees (for the tests) -------------------------------------------------
def reach(netns: str | None, address: str, port: int, timeout: float = 1.5) -> str:
    """A TCP connection from a namespace (None: the node): 'served' when it is made, 'timed out'
    when it is dropped (what a policy does), else the error's name (a closed port: ConnectionRefusedError)."""
    try:
        connect_from(netns, address, port, timeout).close()
        return "served"
    except TimeoutError:
        return "timed out"
    except OSError as exc:
        return type(exc).__name__


K = TypeVar("K", bound=Hashable)


def reach_all(probes: Mapping[K, tuple[str | None, str, int]], timeout: float = 1.5) -> dict[K, str]:
    """reach() for every (netns, address, port) at once: a dropped connection answers only when its
    timeout runs out, so one probe after another waited that out once per refused target."""
    with ThreadPoolExecutor(max_workers=max(1, len(probes))) as pool:
        futures = {key: pool.submit(reach, netns, address, port, timeout) for key, (netns, address, port) in probes.items()}
    return {key: future.result() for key, future in futures.items()}


def http_get_from(netns: str | None, address: str, path: str, headers: dict[str, str], timeout: float
                  ) -> tuple[int, bytes]:
    """GET http://address/path from inside a namespace: (status, body)."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    connection.sock = connect_from(netns, host, int(port), timeout)
    try:
        connection.request("GET", path, headers=headers)
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()
