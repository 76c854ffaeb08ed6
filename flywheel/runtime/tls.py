"""TLS for every listener (gRPC, the HTTP APIs, /metrics) and every client of them.

A service serves TLS when it has a certificate and key (`server.tls.cert_file`,
`key_file`); it then serves nothing in plaintext. With `client_ca_file` it
also requires clients to present a certificate that chains to that CA (mutual
TLS). Its own calls to the others use TLS when it has `ca_file`, the CA the
servers it calls must chain to (their names, or the IP addresses dialled, must
be in their certificates); under mutual TLS it presents its own certificate.

Each setting falls back to an env variable (FLYWHEEL_TLS_CERT_FILE,
FLYWHEEL_TLS_KEY_FILE, FLYWHEEL_TLS_CLIENT_CA_FILE, FLYWHEEL_TLS_CA_FILE), so
one Secret mounted into every container turns TLS on everywhere, and clients
that have no server config (the controller's run, tools, tests) read the same
variables.

A process has one TLS identity: a service's bootstrap adopts its config for
every client and HTTP listener the process opens afterwards (`adopt`,
`process_tls`), so no call site has to carry it; a process that adopted
nothing reads the env variables.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import Field

from flywheel.runtime.config import ConfigError, StrictModel

ENV = {
    "cert_file": "FLYWHEEL_TLS_CERT_FILE",
    "key_file": "FLYWHEEL_TLS_KEY_FILE",
    "client_ca_file": "FLYWHEEL_TLS_CLIENT_CA_FILE",
    "ca_file": "FLYWHEEL_TLS_CA_FILE",
}


class TlsConfig(StrictModel):
    cert_file: Path | None = Field(
        None, description="this service's certificate chain (PEM); with key_file every listener (gRPC, HTTP, "
        "/metrics) serves TLS only. Presented as its client certificate under mutual TLS. Falls back to env "
        "FLYWHEEL_TLS_CERT_FILE",
    )
    key_file: Path | None = Field(None, description="the certificate's private key (PEM); env FLYWHEEL_TLS_KEY_FILE")
    client_ca_file: Path | None = Field(
        None, description="CA (PEM) that clients' certificates must chain to; set: mutual TLS, a client without "
        "such a certificate is refused. Env FLYWHEEL_TLS_CLIENT_CA_FILE",
    )
    ca_file: Path | None = Field(
        None, description="CA (PEM) the services this one calls must chain to; set: its calls use TLS and verify "
        "the server. Env FLYWHEEL_TLS_CA_FILE",
    )


@dataclass(frozen=True)
class TlsFiles:
    """A TLS config with its env fallbacks applied; every file checked to exist."""

    cert_file: Path | None = None
    key_file: Path | None = None
    client_ca_file: Path | None = None
    ca_file: Path | None = None

    @property
    def serving(self) -> bool:
        return self.cert_file is not None

    @property
    def calling(self) -> bool:
        return self.ca_file is not None

    def read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return Path(path).read_bytes() if path is not None else None


def resolve(config: TlsConfig | None = None, env: Mapping[str, str] | None = None) -> TlsFiles:
    env = os.environ if env is None else env
    values: dict[str, Path | None] = {}
    for name, variable in ENV.items():
        value = getattr(config, name) if config is not None else None
        values[name] = Path(value) if value else (Path(env[variable]) if env.get(variable) else None)
        if values[name] is not None and not values[name].is_file():
            raise ConfigError(f"tls.{name}: {values[name]} is not a file (or env {variable})")
    if (values["cert_file"] is None) != (values["key_file"] is None):
        raise ConfigError("tls.cert_file and tls.key_file: set both or neither")
    if values["client_ca_file"] is not None and values["cert_file"] is None:
        raise ConfigError("tls.client_ca_file: mutual TLS needs the server's own cert_file and key_file")
    return TlsFiles(**values)


_adopted: TlsFiles | None = None


def adopt(files: TlsFiles) -> None:
    """Makes `files` this process's TLS for every client it opens from now on."""
    global _adopted
    _adopted = files


def process_tls() -> TlsFiles:
    """This process's TLS, for its clients and HTTP listeners: what it adopted, else the env variables."""
    return _adopted if _adopted is not None else resolve()


def _client_identity(files: TlsFiles) -> tuple[bytes | None, bytes | None]:
    # A certificate is presented only where one could be asked for: a service's own, under mutual TLS.
    return (files.read("key_file"), files.read("cert_file")) if files.serving else (None, None)


def server_credentials(files: TlsFiles) -> Any:
    """grpc server credentials, None when not serving TLS."""
    import grpc

    if not files.serving:
        return None
    return grpc.ssl_server_credentials(
        [(files.read("key_file"), files.read("cert_file"))],
        root_certificates=files.read("client_ca_file"),
        require_client_auth=files.client_ca_file is not None,
    )


def channel_credentials(files: TlsFiles) -> Any:
    """grpc channel credentials verifying the server against `ca_file`; None: plaintext."""
    import grpc

    if not files.calling:
        return None
    key, cert = _client_identity(files)
    return grpc.ssl_channel_credentials(root_certificates=files.read("ca_file"), private_key=key, certificate_chain=cert)


def server_ssl_context(files: TlsFiles) -> ssl.SSLContext | None:
    """For the HTTP listeners; None when not serving TLS."""
    if not files.serving:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.cert_file, files.key_file)
    if files.client_ca_file is not None:
        context.load_verify_locations(cafile=files.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(files: TlsFiles) -> ssl.SSLContext | None:
    """For HTTP clients (verifying the server against `ca_file`); None: plaintext."""
    if not files.calling:
        return None
    context = ssl.create_default_context(cafile=files.ca_file)
    if files.serving:
        context.load_cert_chain(files.cert_file, files.key_file)
    return context


def scheme(files: TlsFiles) -> str:
    """The URL scheme of HTTP endpoints this process calls."""
    return "https" if files.calling else "http"


def describe(files: TlsFiles) -> dict[str, str]:
    """For logs: which files are in use (paths only)."""
    return {f.name: str(getattr(files, f.name)) for f in fields(files) if getattr(files, f.name) is not None}
