"""Container healthcheck: asks a Flywheel service's grpc.health.v1 service whether it is SERVING.

    python /opt/flywheel/healthcheck.py 127.0.0.1:50052   # explicit address (compose does this)
    python /opt/flywheel/healthcheck.py                   # the image's HEALTHCHECK: port found below

Exits 0 when SERVING, 1 otherwise (not serving, unreachable, timeout), which
is what Docker's HEALTHCHECK expects. The health service is exempt from auth,
so no token is needed; with FLYWHEEL_TLS_* set it asks over TLS. Without an argument the port is the one
`FLYWHEEL_<SVC>__SERVER__PORT` variable the container sets, else the default
port of the service PID 1 runs (`python -m services.<name>`), so the built-in
HEALTHCHECK works for every service without knowing which one the image runs.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_PORT_VAR = re.compile(r"^FLYWHEEL_[A-Z]+__SERVER__PORT$")
_CONFIG_CLASSES = {
    "synchronizer": "SynchronizerConfig",
    "trainer": "TrainerConfig",
    "rollout": "RolloutConfig",
    "controller": "ControllerConfig",
}


def _service_of_pid1() -> str | None:
    try:
        argv = Path("/proc/1/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    for arg in argv:
        name = arg.removeprefix("services.")
        if arg.startswith("services.") and name in _CONFIG_CLASSES:
            return name
    return None


def default_address(env: dict[str, str]) -> str:
    ports = sorted(value for name, value in env.items() if _PORT_VAR.match(name))
    if len(ports) == 1:
        return f"127.0.0.1:{ports[0]}"
    service = _service_of_pid1()
    if len(ports) > 1 or service is None:
        raise SystemExit("healthcheck: pass HOST:PORT, or set exactly one FLYWHEEL_<SVC>__SERVER__PORT")
    config_cls = getattr(importlib.import_module(f"services.{service}.config"), _CONFIG_CLASSES[service])
    return f"127.0.0.1:{config_cls().server.port}"


def _channel(address: str) -> grpc.Channel:
    """Plaintext, or with FLYWHEEL_TLS_* set TLS as the service's own clients use it (its certificate
    presented under mutual TLS). The service is asked on 127.0.0.1, which its certificate need not
    name, so the name checked is the first DNS name the certificate holds."""
    from flywheel.runtime import tls

    files = tls.resolve()
    credentials = tls.channel_credentials(files)
    if credentials is None:
        return grpc.insecure_channel(address)
    options = []
    if files.cert_file is not None:
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(files.cert_file.read_bytes())
        try:
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.DNSName)
        except x509.ExtensionNotFound:
            names = []
        if names:
            options.append(("grpc.ssl_target_name_override", names[0]))
    return grpc.secure_channel(address, credentials, options=options)


def check(address: str, timeout: float = 3.0) -> bool:
    with _channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as exc:
            print(f"healthcheck: {address}: {exc.code().name}", file=sys.stderr)
            return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"healthcheck: {address}: {status}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else default_address(dict(os.environ))
    sys.exit(0 if check(target) else 1)
