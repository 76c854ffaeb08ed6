"""Which manifest fields the deployment harness plays, and which it knowingly
ignores: a field it does neither fails the test, naming the field, so that a
manifest never passes on behaviour nobody emulated.

    check_workload(deployment, "kubernetes/cpu Deployment/flywheel-rollout")
    check_compose_service(spec, "compose/trainer")
    check_compose_volume(spec, "compose volume weights-shm")
    check_network_policy(policy["spec"], "NetworkPolicy/flywheel-service-ports")

Fields are named by pattern: `pod.` a pod template's spec, `container.` an
entry of its containers or initContainers, `volume.` an entry of its volumes,
`workload.` the Deployment/StatefulSet/Job spec around the template,
`service.` a compose service, `compose-volume.` a compose top-level volume,
`policy.` a NetworkPolicy's spec (netpol.py enforces it), `selector.` a label
selector in one.
`[]` stands for a list's items, `*` for any key of a free-form mapping
(environment variables, labels, depends_on's services). A field is accepted
when its pattern is in IMPLEMENTED (kube.py and compose.py do what it says)
or in NO_OPS (they do nothing, for the reason given); a pattern's subfields
are checked where IMPLEMENTED names any, otherwise the field's whole value is
accepted (a command, a probe's port).
"""

from __future__ import annotations

from typing import Any

#: Fields the harness knowingly treats as no-ops: pattern -> why that is acceptable here.
NO_OPS: dict[str, str] = {
    # Kubernetes: the workload controllers
    "workload.strategy": "pods are created once; no rolling update is ever made",
    "workload.podManagementPolicy": "every pod starts at once (Parallel); OrderedReady's ordering is not played",
    "workload.backoffLimit": "a Job's retries are not played: the test wants its first pod to succeed",
    # Kubernetes: the pod and its containers
    "pod.securityContext.seccompProfile":
        "no seccomp filter is loaded (RuntimeDefault only blocks syscalls Python never makes)",
    "pod.tolerations": "one node without taints: every pod is scheduled",
    "pod.topologySpreadConstraints": "one node: spreading cannot be played",
    "container.image": "every Flywheel image is this repository (the tag picks the Dockerfile stage it reads)",
    "container.imagePullPolicy": "nothing is pulled: the image is this repository",
    "container.resources": "no cgroups: requests and limits are neither reserved nor enforced (no GPU either)",
    "container.ports": "informational in Kubernetes too; named ports are looked up for probes and Services",
    "volume.emptyDir.sizeLimit": "no quota: the directory is not evicted when it grows",
    "volume.emptyDir.medium": "a directory on disk rather than tmpfs (same ownership and modes)",
    # docker compose
    "service.build": "the image is this repository; build.target picks the Dockerfile stage it reads",
    "service.image": "the image is this repository",
    "service.restart": "not played: a service that may be restarted (anything but \"no\") fails the test if it exits",
    "service.init": "no init process: the harness kills whatever is left in the container's namespace at the end",
    "service.ports": "no host ports are published: tests reach each container at its own address",
    "service.shm_size": "/dev/shm is the host's (not sized per container)",
    "service.ulimits": "the host's limits apply",
    "service.deploy": "no GPU: device reservations are not played (the gpu profile does not run here)",
    "service.healthcheck.retries": "a container is healthy at its first passing check and never marked unhealthy",
    "service.healthcheck.start_period": "checks run from the start; failures never count against the container",
    "compose-volume.driver_opts.type": "a directory stands in for the tmpfs (its uid/gid/mode options are applied)",
    "compose-volume.driver_opts.device": "a directory stands in for the tmpfs",
}

#: Fields kube.py / compose.py play as Kubernetes and Docker do.
IMPLEMENTED: frozenset[str] = frozenset({
    "workload.replicas", "workload.serviceName", "workload.selector", "workload.selector.matchLabels",
    "workload.template", "workload.template.metadata",
    "workload.template.metadata.labels", "workload.template.metadata.annotations", "workload.template.spec",
    "pod.containers", "pod.initContainers", "pod.volumes", "pod.restartPolicy", "pod.terminationGracePeriodSeconds",
    "pod.securityContext", "pod.securityContext.runAsUser", "pod.securityContext.runAsGroup",
    "pod.securityContext.runAsNonRoot", "pod.securityContext.fsGroup", "pod.securityContext.supplementalGroups",
    "container.name", "container.command", "container.args", "container.workingDir",
    "container.env", "container.env[].name", "container.env[].value", "container.env[].valueFrom",
    "container.env[].valueFrom.configMapKeyRef", "container.env[].valueFrom.secretKeyRef",
    "container.env[].valueFrom.fieldRef", "container.env[].valueFrom.fieldRef.fieldPath",
    "container.volumeMounts", "container.volumeMounts[].name", "container.volumeMounts[].mountPath",
    "container.volumeMounts[].readOnly",
    *(f"container.{probe}{part}" for probe in ("startupProbe", "readinessProbe", "livenessProbe") for part in (
        "", ".grpc", ".httpGet", ".tcpSocket", ".exec", ".initialDelaySeconds", ".periodSeconds", ".timeoutSeconds",
        ".successThreshold", ".failureThreshold")),
    "container.securityContext", "container.securityContext.runAsUser", "container.securityContext.runAsGroup",
    "container.securityContext.runAsNonRoot", "container.securityContext.allowPrivilegeEscalation",
    "container.securityContext.capabilities", "container.securityContext.capabilities.drop",
    "volume.name", "volume.emptyDir", "volume.persistentVolumeClaim", "volume.persistentVolumeClaim.claimName",
    "volume.persistentVolumeClaim.readOnly",
    *(f"volume.{kind}.{key}" for kind in ("configMap", "secret") for key in ("defaultMode", "items", "items[].key",
                                                                             "items[].path", "items[].mode")),
    "volume.configMap", "volume.configMap.name", "volume.secret", "volume.secret.secretName",
    "service.command", "service.environment", "service.environment.*", "service.env_file", "service.env_file[].path",
    "service.env_file[].required", "service.volumes", "service.user", "service.profiles", "service.depends_on",
    "service.depends_on.*", "service.depends_on.*.condition", "service.depends_on.*.required",
    "service.healthcheck", "service.healthcheck.test", "service.healthcheck.interval", "service.healthcheck.timeout",
    "service.networks", "service.networks.default", "service.networks.default.aliases", "service.hostname",
    "service.secrets", "service.secrets[].source", "service.secrets[].target",
    "compose-volume.driver_opts", "compose-volume.driver_opts.o",
    # NetworkPolicy (netpol.py): Ingress only; egress and any other field is refused.
    "policy.podSelector", "policy.policyTypes", "policy.ingress", "policy.ingress[].from", "policy.ingress[].ports",
    "policy.ingress[].from[].podSelector", "policy.ingress[].from[].namespaceSelector",
    "policy.ingress[].from[].ipBlock", "policy.ingress[].from[].ipBlock.cidr", "policy.ingress[].from[].ipBlock.except",
    "policy.ingress[].ports[].port", "policy.ingress[].ports[].protocol", "policy.ingress[].ports[].endPort",
    "selector.matchLabels", "selector.matchExpressions", "selector.matchExpressions[].key",
    "selector.matchExpressions[].operator", "selector.matchExpressions[].values",
})

#: Lists whose items are objects of their own kind.
_ITEMS = {"pod.containers[]": "container", "pod.initContainers[]": "container", "pod.volumes[]": "volume",
          "workload.template.spec": "pod", "policy.podSelector": "selector",
          "policy.ingress[].from[].podSelector": "selector", "policy.ingress[].from[].namespaceSelector": "selector"}


def _has_subfields(pattern: str) -> bool:
    return any(p.startswith((pattern + ".", pattern + "[].")) for p in IMPLEMENTED) or pattern in _ITEMS


def _check(value: Any, pattern: str, where: str, owner: str) -> None:
    pattern = _ITEMS.get(pattern, pattern)
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check(item, pattern + "[]", f"{where}[{index}]", owner)
        return
    if not isinstance(value, dict) or not _has_subfields(pattern):
        return
    for key, child in value.items():
        field, path = f"{pattern}.{key}", f"{where}.{key}" if where else key
        if field not in NO_OPS and field not in IMPLEMENTED and f"{pattern}.*" in IMPLEMENTED:
            field = f"{pattern}.*"
        if field in NO_OPS:
            continue
        if field not in IMPLEMENTED:
            raise AssertionError(
                f"{owner}: field {path} ({field}) is not implemented by the deployment harness: "
                "emulate it, or list it in tests/deploy/fields.py NO_OPS with the reason it may be ignored")
        _check(child, field, path, owner)


def check_workload(workload: dict[str, Any], owner: str) -> None:
    """A Deployment, StatefulSet or Job: its spec, pod template, containers and volumes."""
    _check(workload["spec"], "workload", "spec", owner)


def check_pod(spec: dict[str, Any], owner: str) -> None:
    """A bare Pod's spec (what `kubectl run` creates): its containers and volumes."""
    _check(spec, "pod", "spec", owner)


def check_network_policy(spec: dict[str, Any], owner: str) -> None:
    """A NetworkPolicy's spec: the fields netpol.py enforces, and no others."""
    _check(spec, "policy", "spec", owner)


def check_compose_service(service: dict[str, Any], owner: str) -> None:
    _check(service, "service", "", owner)


def check_compose_volume(volume: dict[str, Any] | None, owner: str) -> None:
    _check(volume or {}, "compose-volume", "", owner)
