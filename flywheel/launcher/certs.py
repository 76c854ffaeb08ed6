"""A throwaway certificate authority: one CA and one certificate for the services, made on
the spot (the local launcher's `launch.tls`, and tests).

The certificate is good for both ends of a connection (server and client
authentication), since under mutual TLS every service presents its own when
it calls another. Its names are the hosts given (IP addresses or DNS names);
clients check the address they dial against them. Keys are written readable by
the owner only. Deployments bring their own certificates (a Secret); nothing
here is meant to outlive the run that made it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flywheel.runtime.addresses import LOOPBACK_HOSTS

#: The names a certificate is good for unless told: this machine's loopback.
DEFAULT_HOSTS = LOOPBACK_HOSTS


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path


def _write_key(path: Path, key) -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_pki(directory: Path, hosts: Sequence[str] = DEFAULT_HOSTS, *, name: str = "flywheel",
             days: int = 30) -> Pki:
    """Writes ca.pem, service.pem and service.key into `directory` (made if missing)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid_from, valid_to = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} throwaway CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid_from).not_valid_after(valid_to)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} service")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid_from).not_valid_after(valid_to)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    from cryptography.hazmat.primitives import serialization

    pki = Pki(ca_file=directory / "ca.pem", cert_file=directory / "service.pem", key_file=directory / "service.key")
    pki.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.key_file, key)
    # The CA's key is not kept: nothing more is ever signed with it.
    return pki


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m flywheel.launcher.certs DIR --hosts NAME...`: a throwaway CA and one certificate
    for a deployment, written under the keys of a Kubernetes TLS Secret (ca.crt, tls.crt, tls.key),
    the names deploy/ mounts (Secret flywheel-tls, compose's FLYWHEEL_TLS_DIR)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flywheel.launcher.certs", description=main.__doc__)
    parser.add_argument("directory", type=Path, help="where to write ca.crt, tls.crt and tls.key (made if missing)")
    parser.add_argument("--hosts", nargs="+", default=list(DEFAULT_HOSTS),
                        help="the names and IP addresses the certificate holds (a DNS name may be a *.wildcard)")
    parser.add_argument("--days", type=int, default=30, help="how long it is valid")
    args = parser.parse_args(argv)
    pki = make_pki(args.directory, args.hosts, days=args.days)
    for made, name in ((pki.ca_file, "ca.crt"), (pki.cert_file, "tls.crt"), (pki.key_file, "tls.key")):
        made.replace(args.directory / name)
    print(f"{args.directory}: ca.crt, tls.crt, tls.key (for {', '.join(args.hosts)}; valid {args.days} days)")


if __name__ == "__main__":
    main()
