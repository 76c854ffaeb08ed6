"""The parts of Kubernetes a rendered overlay needs to run, on a namespace
cluster (cluster.py): enough of the kubelet, kube-proxy, CoreDNS and the
workload controllers that the manifests run as written.

    kube = Kube(cluster, objects, workdir)   # objects: kubectl kustomize output + the Secret
    kube.apply()                              # Services, then every workload's pods
    ...                                       # kube.pods, kube.service_address(...)
    kube.stop()

What is emulated, each as Kubernetes documents it:
- Pods: one network namespace each, with the pod's IP, hostname (the pod
  name; StatefulSet pods also get `<pod>.<serviceName>`), the kubelet's
  /etc/hosts and a resolv.conf naming the cluster DNS with the namespace's
  search domains and ndots:5. Init containers run in order to completion
  before the containers start. `command`/`args`/env values expand `$(VAR)`;
  env comes from values, ConfigMap and Secret keys and the downward API
  (status.podIP, metadata.name, metadata.namespace), plus the service links
  (`<SERVICE>_SERVICE_HOST`...) of every ClusterIP Service.
- Users: each container runs (setpriv) as its securityContext's runAsUser/
  runAsGroup, else the pod's, else the image's USER (Dockerfile), with
  fsGroup and supplementalGroups as supplementary groups; runAsNonRoot with
  uid 0 is refused as the kubelet refuses it; allowPrivilegeEscalation: false
  sets no_new_privs, capabilities.drop [ALL] empties the bounding set. Exec
  probes run as the container's user. Each container gets its own copy of
  the image's home directory (HOME, owned as the image has it) and starts in
  the image's WORKDIR unless workingDir says otherwise.
- Volumes: configMap and secret (keys as files, `items` and modes honoured),
  emptyDir, persistentVolumeClaim (one directory per claim), each mount
  read-only where the manifest says so, owned and moded as the kubelet
  leaves them, fsGroup included (volumes.py).
- Bare Pods (`kind: Pod`, what `kubectl run` makes), run like a workload's.
- Fields: every workload, bare Pod and NetworkPolicy is checked against
  fields.py first; a field that is neither played nor listed there as a no-op
  (with its reason) fails the test, naming it.
- NetworkPolicies (Ingress), enforced with nftables in each selected pod's
  network namespace once every pod has its address, before any container
  starts (netpol.py, which also says how Service traffic keeps its client).
- Probes, as the kubelet runs them from the node (this namespace) to the pod
  IP: startup first, then readiness and liveness, each with its period,
  timeout, initial delay and thresholds; grpc (grpc.health.v1 Check, no
  credentials), httpGet, tcpSocket and exec (in the container, with its
  environment). A failed startup or liveness probe restarts the container
  (counted in `restarts`).
- Restart policy: Always restarts an exited container (Deployments,
  StatefulSets); Never leaves the pod Succeeded or Failed (the Job).
- Termination (a failed probe's restart, and `stop()`): SIGTERM, then SIGKILL
  once the pod's terminationGracePeriodSeconds have passed.
- Services: a ClusterIP Service gets a virtual IP in this namespace with a
  user-space proxy to its ready endpoints (kube-proxy's userspace mode), which
  connects to the endpoint from the client pod's network namespace; a
  headless one resolves to its endpoints' pod IPs, not-ready ones included
  where publishNotReadyAddresses says so. DNS: `<svc>.<ns>.svc.cluster.local`,
  `<pod hostname>.<svc>.<ns>.svc.cluster.local` and every pod's
  `<IP with dashes>.<ns>.pod.cluster.local` (CoreDNS's `pods verified`),
  answered by a small DNS server on the bridge (NXDOMAIN otherwise, so search
  domains work).

Not emulated (fields.py NO_OPS says why for each pod field): resource
requests and limits, seccomp profiles, scheduling constraints (one node), disruption budgets,
egress NetworkPolicies (refused), a Job's retries (the test wants its first pod to succeed),
rolling updates.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.deploy.cluster import DnsServer, NamespaceCluster, connect_from
from tests.deploy.fields import check_pod, check_workload
from tests.deploy.image import Identity, image_directories, image_home, image_target, image_user, image_workdir
from tests.deploy.manifests import ROOT, WORKLOAD_KINDS, image_files, k8s_env, k8s_expand, selects, workloads
from tests.deploy.netpol import Member, apply_ruleset, check_policy, ingress_rulesets
from tests.deploy.pods import PROBE_DEFAULTS, Container, Pod, container_port, probe_once
from tests.deploy.volumes import EMPTY_DIR, ROOT_DIRECTORY, apply_fs_group, make_directory, write_key_files

CLUSTER_DOMAIN = "cluster.local"
#: The image's ENV and WORKDIR (Dockerfile), with the virtualenv standing in for /opt/venv.
IMAGE_PATH = f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Kube:
    def __init__(self, cluster: NamespaceCluster, objects: list[dict[str, Any]], workdir: Path) -> None:
        self.cluster, self.objects, self.workdir = cluster, objects, workdir
        (self.namespace,) = {o["metadata"]["namespace"] for o in objects if "namespace" in o["metadata"]}
        self.pods: list[Pod] = []
        self.services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        self.cluster_ips: dict[str, str] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self.errors: list[str] = []
        self._dns: DnsServer | None = None
        self._claims_lock = threading.Lock()
        unknown = {o["kind"] for o in objects} - {"Namespace", "ConfigMap", "Secret", "Service", "PersistentVolumeClaim",
                                                  "PodDisruptionBudget", "NetworkPolicy", "Pod", *WORKLOAD_KINDS}
        assert not unknown, f"kinds this emulation does not run: {unknown}"
        self.policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        for policy in self.policies:  # a policy field or value nobody enforces fails here, naming it
            check_policy(policy, f"NetworkPolicy/{policy['metadata']['name']}")
        self.bare_pods = [o for o in objects if o["kind"] == "Pod"]
        for bare in self.bare_pods:
            check_pod(bare["spec"], f"Pod/{bare['metadata']['name']}")
        for workload in workloads(objects):  # a field nobody plays fails here, naming it
            name = f"{workload['kind']}/{workload['metadata']['name']}"
            check_workload(workload, name)
            # The apiserver refuses a workload whose selector does not select its own template.
            selector = workload["spec"].get("selector", {}).get("matchLabels")
            assert selector is None or selects(selector, workload["spec"]["template"]["metadata"].get("labels", {})), (
                f"{name}: spec.selector does not match the template's labels")

    # -- objects ----------------------------------------------------------------
    def find(self, kind: str, name: str) -> dict[str, Any]:
        (found,) = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        return found

    def apply(self, held: Callable[[Pod], bool] = lambda pod: False) -> None:
        """Creates every object; a pod `held` picks is placed (address, policies) but stays Pending
        until `release`, as a user applies a Job once what it needs is up."""
        for name, svc in self.services.items():
            if svc["spec"].get("clusterIP") != "None":
                self.cluster_ips[name] = self.cluster.add_address()
                for port in svc["spec"]["ports"]:
                    self._spawn(self._proxy, name, port)
        self._dns = DnsServer(self.cluster.gateway, self._records)
        for workload in [*workloads(self.objects), *self.bare_pods]:
            replicas = 1 if workload["kind"] in ("Job", "Pod") else workload["spec"].get("replicas", 1)
            for index in range(replicas):
                self._create_pod(workload, index)
        self.enforce()  # isolated before any container starts, as the network plugin sets a pod's network up first
        for pod in self.pods:
            if not held(pod):
                self._spawn(self._kubelet, pod)

    def release(self, pod: Pod) -> None:
        """Starts a pod `apply` held."""
        self._spawn(self._kubelet, pod)

    def enforce(self) -> None:
        """Every pod's NetworkPolicy table, from the pods there are now (rules name pods by IP)."""
        if not self.policies:
            return
        assert shutil.which("nft"), "nft not found (Debian: nftables): the NetworkPolicies cannot be enforced"
        members = [Member(p.name, p.ip, self.namespace, p.labels, {
            port["name"]: (port["containerPort"], port.get("protocol", "TCP"))
            for c in p.spec["containers"] for port in c.get("ports", []) if "name" in port}) for p in self.pods]
        namespaces = {o["metadata"]["name"]: o["metadata"].get("labels") or {}
                      for o in self.objects if o["kind"] == "Namespace"}
        namespaces.setdefault(self.namespace, {})
        rulesets = ingress_rulesets(self.policies, members, namespaces, node=[self.cluster.gateway])
        for pod in self.pods:
            apply_ruleset(pod.host.netns, rulesets[pod.name])

    def _create_pod(self, workload: dict[str, Any], index: int) -> None:
        name, kind = workload["metadata"]["name"], workload["kind"]
        suffix = lambda n: "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=n))  # noqa: E731
        pod_name = {"StatefulSet": f"{name}-{index}", "Job": f"{name}-{suffix(5)}", "Pod": name}.get(
            kind, f"{name}-{hashlib.sha1(name.encode()).hexdigest()[:10]}-{suffix(5)}")
        template = workload["spec"]["template"] if kind != "Pod" else {"metadata": workload["metadata"],
                                                                       "spec": workload["spec"]}
        subdomain = workload["spec"].get("serviceName", "") if kind == "StatefulSet" else ""
        host = self.cluster.add_host(pod_name, names=[], hostname=pod_name)
        home = self.workdir / "pods" / pod_name
        home.mkdir(parents=True)
        pod = Pod(pod_name, workload, template["spec"], template["metadata"].get("labels", {}),
                  template["metadata"].get("annotations", {}), host, home, subdomain)
        fqdn = f"{pod_name}.{subdomain}.{self.namespace}.svc.{CLUSTER_DOMAIN}" if subdomain else ""
        self.cluster.write_etc(
            host,
            hosts=["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                   f"{host.address} {fqdn} {pod_name}" if fqdn else f"{host.address} {pod_name}"],
            resolv=[f"search {self.namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}",
                    f"nameserver {self.cluster.gateway}", "options ndots:5"],
        )
        self.pods.append(pod)

    # -- the kubelet ------------------------------------------------------------
    def _volumes(self, pod: Pod) -> dict[str, tuple[Path, bool]]:
        """volume name -> (directory, read-only by the volume itself), owned as the kubelet
        leaves them (volumes.py): fsGroup's group where the pod sets one."""
        found = {}
        fs_group = (pod.spec.get("securityContext") or {}).get("fsGroup")
        for volume in pod.spec.get("volumes", []):
            name = volume["name"]
            if "configMap" in volume or "secret" in volume:
                kind, ref = ("ConfigMap", volume["configMap"]["name"]) if "configMap" in volume else (
                    "Secret", volume["secret"]["secretName"])
                source = self.find(kind, ref)
                data = dict(source.get("data") or {})
                if kind == "Secret":
                    data = {k: base64.b64decode(v).decode() for k, v in data.items()}
                spec = volume.get("configMap") or volume["secret"]
                mode = spec.get("defaultMode", 0o644)
                items = spec.get("items") or [{"key": k, "path": k} for k in data]
                directory = pod.home / "volumes" / name
                write_key_files(directory, {i["path"]: (data[i["key"]], i.get("mode", mode)) for i in items})
                read_only = True  # the kubelet mounts these read-only
            elif "emptyDir" in volume:
                directory = make_directory(pod.home / "volumes" / name, EMPTY_DIR)
                read_only = False
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]
                self.find("PersistentVolumeClaim", claim["claimName"])  # it must exist
                directory = self.workdir / "claims" / claim["claimName"]
                with self._claims_lock:
                    if not directory.exists():  # provisioned: a new filesystem's root
                        make_directory(directory, ROOT_DIRECTORY)
                read_only = bool(claim.get("readOnly"))
            else:
                raise AssertionError(f"{pod.name}: volume {name} is of a type this emulation does not mount: {volume}")
            if fs_group is not None:
                # A claim is shared: two kubelets' walks reading and writing the same modes would lose one's
                # grant (a read-only mount's chmod undoing another pod's group write), so they take turns.
                with self._claims_lock:
                    apply_fs_group(directory, fs_group, read_only)
            found[name] = (directory, read_only)
        return found

    def identity(self, pod: Pod, spec: dict[str, Any]) -> Identity:
        """Who the container runs as: its securityContext, then the pod's, then the image's USER;
        fsGroup and supplementalGroups as supplementary groups (what the kubelet hands the runtime)."""
        image = image_user(image_target(spec["image"]))
        pod_context, context = pod.spec.get("securityContext") or {}, spec.get("securityContext") or {}
        setting = lambda key, default=None: context.get(key, pod_context.get(key, default))  # noqa: E731
        uid = setting("runAsUser", image.uid)
        # Without runAsGroup the runtime takes the user's group from the image (its USER, or root's).
        gid = setting("runAsGroup", image.gid if uid == image.uid else 0)
        if setting("runAsNonRoot") and uid == 0:  # the kubelet refuses to create the container
            raise AssertionError(f"{pod.name}/{spec['name']}: CreateContainerConfigError: container has "
                                 "runAsNonRoot and image will run as root")
        groups = [g for g in [pod_context.get("fsGroup"), *pod_context.get("supplementalGroups", [])] if g is not None]
        drop = (context.get("capabilities") or {}).get("drop")
        assert drop in (None, ["ALL"]), f"{pod.name}/{spec['name']}: capabilities.drop {drop}: only [ALL] is played"
        return Identity(uid, gid, tuple(dict.fromkeys(groups)), drop_capabilities=drop == ["ALL"],
                        no_new_privs=context.get("allowPrivilegeEscalation") is False)

    def _service_links(self) -> dict[str, str]:
        """enableServiceLinks (the default): every ClusterIP Service as variables."""
        env = {}
        for name, ip in self.cluster_ips.items():
            key = name.upper().replace("-", "_")
            ports = self.services[name]["spec"]["ports"]
            env[f"{key}_SERVICE_HOST"], env[f"{key}_SERVICE_PORT"] = ip, str(ports[0]["port"])
            env[f"{key}_PORT"] = f"tcp://{ip}:{ports[0]['port']}"
            for port in ports:
                if "name" in port:
                    env[f"{key}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
                prefix = f"{key}_PORT_{port['port']}_TCP"
                env.update({prefix: f"tcp://{ip}:{port['port']}", f"{prefix}_PROTO": "tcp",
                            f"{prefix}_PORT": str(port["port"]), f"{prefix}_ADDR": ip})
        return env

    def _start(self, pod: Pod, spec: dict[str, Any], volumes: dict[str, tuple[Path, bool]]) -> subprocess.Popen:
        target = image_target(spec["image"])
        user, home = self.identity(pod, spec), image_home(target)
        fields = {"status.podIP": pod.ip, "metadata.name": pod.name, "metadata.namespace": self.namespace}
        env = {"PATH": IMAGE_PATH, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
               # HOME from the image's /etc/passwd: its user's home, "/" for any other uid.
               "HOME": home if user.uid == image_user(target).uid else "/",
               "HF_HOME": f"{home}/.cache/huggingface", "HOSTNAME": pod.name, **self._service_links()}
        env.update(k8s_env(spec, self.objects, fields))
        argv = [k8s_expand(a, env) for a in [*spec.get("command", []), *spec.get("args", [])]]
        # The image's interpreter, or the image's shell handing over to it (`sh -c '...; exec python ...'`).
        assert argv and (argv[0] == "python" or argv[:2] == ["sh", "-c"] and "exec python " in argv[2]), (
            f"{pod.name}/{spec['name']}: the image's interpreter is `python`: {argv}")
        pod.envs[spec["name"]], pod.users[spec["name"]] = env, user
        mounts = {target_path: (source, True) for target_path, source in image_files().items()}
        # The container's own copy of the image's home directory (its writable layer), owned as the image has it.
        mounts[home] = (make_directory(pod.home / "homes" / spec["name"], image_directories(target)[home]), False)
        for mount in spec.get("volumeMounts", []):
            assert "subPath" not in mount, f"{pod.name}: subPath is not emulated"
            source, read_only = volumes[mount["name"]]
            mounts[mount["mountPath"]] = (source, read_only or bool(mount.get("readOnly")))
        cwd = Path(spec.get("workingDir") or image_workdir(target))
        with pod.log.open("a") as out:
            out.write(f"--- {spec['name']}: {' '.join(argv)}\n")
        return self.cluster.run(pod.host, argv, env=env, mounts=mounts, cwd=cwd, log=pod.log, user=user)

    def _kubelet(self, pod: Pod) -> None:
        volumes = self._volumes(pod)
        policy = pod.spec.get("restartPolicy", "Always")
        for init in pod.spec.get("initContainers", []):
            while not self._stopping.is_set():
                code = self._start(pod, init, volumes).wait()
                if code == 0:
                    break
                if policy == "Never":
                    pod.phase = "Failed"
                    return
                time.sleep(10)  # the kubelet's first back-off step
        pod.containers = [Container(spec) for spec in pod.spec["containers"]]
        for c in pod.containers:
            c.proc = self._start(pod, c.spec, volumes)
            c.started = "startupProbe" not in c.spec
        pod.phase = "Running"
        while not self._stopping.is_set():
            now = time.monotonic()
            for c in pod.containers:
                if c.proc is None:
                    continue
                code = c.proc.poll()
                if code is not None:
                    c.exit_code, c.ready, c.proc = code, False, None
                    if policy == "Always" or (policy == "OnFailure" and code != 0):
                        self._restart(pod, c, volumes, kill=False)
                    continue
                self._probe(pod, c, now, volumes)
            if all(c.proc is None for c in pod.containers):
                pod.phase = "Succeeded" if all(c.exit_code == 0 for c in pod.containers) else "Failed"
                return
            time.sleep(0.2)

    def _restart(self, pod: Pod, c: Container, volumes: dict, kill: bool) -> None:
        if self._stopping.is_set():
            return
        if kill and c.proc is not None:
            self._terminate(pod, c.proc)
        # The reason is in the log before the count moves: a test that sees the restart can read why.
        with pod.log.open("a") as out:
            out.write(f"--- {c.name}: restart {c.restarts + 1} ({'probe failed' if kill else f'exited {c.exit_code}'})\n")
        c.restarts += 1
        c.started, c.ready, c.counts, c.due = "startupProbe" not in c.spec, False, {}, {}
        c.proc = self._start(pod, c.spec, volumes)

    def _terminate(self, pod: Pod, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(pod.spec.get("terminationGracePeriodSeconds", 30))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def _probe(self, pod: Pod, c: Container, now: float, volumes: dict) -> None:
        kinds = ["startupProbe"] if not c.started else ["readinessProbe", "livenessProbe"]
        for kind in kinds:
            probe = c.spec.get(kind)
            if probe is None:
                if kind == "readinessProbe":
                    c.ready = True
                continue
            probe = {**PROBE_DEFAULTS, **probe}
            if kind not in c.due:
                c.due[kind] = now + probe["initialDelaySeconds"]
            if now < c.due[kind]:
                continue
            c.due[kind] = now + probe["periodSeconds"]
            ok = probe_once(self.cluster, pod, c, probe)
            counts = c.counts.setdefault(kind, [0, 0])
            counts[:] = [counts[0] + 1, 0] if ok else [0, counts[1] + 1]
            if kind == "startupProbe":
                if ok:
                    c.started = True
                elif counts[1] >= probe["failureThreshold"]:
                    self._restart(pod, c, volumes, kill=True)
            elif kind == "readinessProbe":
                if ok and counts[0] >= probe["successThreshold"]:
                    c.ready = True
                elif not ok and counts[1] >= probe["failureThreshold"]:
                    c.ready = False
            elif not ok and counts[1] >= probe["failureThreshold"]:
                self._restart(pod, c, volumes, kill=True)
                return

    # -- Services -----------------------------------------------------------------
    def endpoints(self, service: str) -> list[Pod]:
        svc = self.services[service]["spec"]
        # A pod has its IP from the start (init containers run in its network namespace already).
        chosen = [p for p in self.pods if selects(svc["selector"], p.labels) and p.phase in ("Pending", "Running")]
        return chosen if svc.get("publishNotReadyAddresses") else [p for p in chosen if p.ready]

    def resolve(self, name: str) -> list[str]:
        """What the cluster DNS answers for a fully qualified name (A records)."""
        pod_suffix = f".{self.namespace}.pod.{CLUSTER_DOMAIN}"
        if name.endswith(pod_suffix):
            address = name.removesuffix(pod_suffix).replace("-", ".")
            return [p.ip for p in self.pods if p.ip == address and p.phase in ("Pending", "Running")]
        suffix = f".{self.namespace}.svc.{CLUSTER_DOMAIN}"
        if not name.endswith(suffix):
            return []
        parts = name.removesuffix(suffix).split(".")
        if len(parts) == 1 and parts[0] in self.services:
            if parts[0] in self.cluster_ips:
                return [self.cluster_ips[parts[0]]]
            return [p.ip for p in self.endpoints(parts[0])]
        if len(parts) == 2 and parts[1] in self.services:
            return [p.ip for p in self.endpoints(parts[1]) if p.name == parts[0] and p.subdomain == parts[1]]
        return []

    def service_address(self, service: str, port_name: str) -> str:
        (port,) = [p["port"] for p in self.services[service]["spec"]["ports"] if p.get("name") == port_name]
        return f"{self.cluster_ips[service]}:{port}"

    def _records(self, name: str) -> list[str] | None:
        """The cluster DNS's answer: A records, or None for a name that does not exist."""
        suffix = f".{self.namespace}.svc.{CLUSTER_DOMAIN}"
        addresses = self.resolve(name)
        if addresses or (name.endswith(suffix) and name.removesuffix(suffix).split(".")[-1] in self.services):
            return addresses
        return None  # NXDOMAIN: the resolver goes on with its next search domain

    def _proxy(self, service: str, port: dict[str, Any]) -> None:
        listener = socket.create_server((self.cluster_ips[service], port["port"]))
        listener.settimeout(0.5)
        self._sockets.append(listener)
        turn = 0
        while not self._stopping.is_set():
            try:
                client, (source, _) = listener.accept()
            except (TimeoutError, OSError):
                continue
            ready = self.endpoints(service)
            if not ready:
                client.close()  # no endpoints: the connection is refused
                continue
            pod = ready[turn % len(ready)]
            turn += 1
            target = container_port(pod, port.get("targetPort", port["port"]))
            self._spawn(self._forward, client, source, pod, target)

    def _forward(self, client: socket.socket, source: str, pod: Pod, port: int) -> None:
        """One proxied connection, made from the client pod's own namespace (its IP, as kube-proxy's DNAT
        leaves it) so that the endpoint's NetworkPolicy judges the client (netpol.py); from the node otherwise.
        A connection the policy drops times out here, and the client's is closed."""
        clients = [p for p in self.pods if p.ip == source]
        try:
            upstream = connect_from(clients[0].host.netns if clients else None, pod.ip, port, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        for a, b in ((client, upstream), (upstream, client)):
            self._spawn(self._pump, a, b)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    # -- lifecycle ------------------------------------------------------------------
    def _spawn(self, target, *args: Any) -> None:
        def guarded() -> None:
            try:
                target(*args)
            except Exception as exc:  # surfaced by check(): a broken emulation must fail the test at once
                self.errors.append(f"{target.__name__}{args[:1]}: {exc!r}")

        thread = threading.Thread(target=guarded, daemon=True)
        thread.start()
        self._threads.append(thread)

    def check(self) -> None:
        """Raises if any part of the emulation itself failed."""
        assert not self.errors, self.errors

    def stop(self) -> None:
        """No more restarts, probes or DNS answers; every container gets SIGTERM, then SIGKILL once
        its pod's terminationGracePeriodSeconds have passed (the cluster then stops what is left)."""
        self._stopping.set()
        if self._dns is not None:
            self._dns.close()
        for sock in self._sockets:
            sock.close()
        running = [(pod, c.proc) for pod in self.pods for c in pod.containers if c.proc is not None]
        for _, proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        for pod, proc in running:
            grace = pod.spec.get("terminationGracePeriodSeconds", 30)
            try:
                proc.wait(max(0.0, start + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
