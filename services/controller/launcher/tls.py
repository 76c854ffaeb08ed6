"""TLS for a run on this machine (`launch.tls`): a throwaway CA in `<run_dir>/tls`, one
certificate every service started here serves and (under mutual TLS) presents.

Why a throwaway CA and not certificates named in the run file: the services a
local run starts listen on this machine's loopback and live as long as the
launch, so a CA made for them (its key never written) is all that is needed to
try TLS end to end without any PKI; a deployment with its own certificates sets
FLYWHEEL_TLS_* instead (inherited by every child, read by this process too), and
then `launch.tls` stays off.

The CA is made once per launch (`LaunchTls.section`): a replica restarted alone,
or every service after a rewind, must keep trusting the ones still running.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.launcher.certs import DEFAULT_HOSTS, make_pki
from flywheel.runtime.tls import TlsFiles, adopt


def _local_names() -> tuple[str, ...]:
    """Loopback, and this machine's name (an advertised address may use it when a service binds 0.0.0.0)."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = None
    return tuple(dict.fromkeys((*DEFAULT_HOSTS, name, *([address] if address else []))))


@dataclass
class LaunchTls:
    mode: bool | str
    run_dir: Path
    _files: TlsFiles | None = field(default=None, init=False)

    def files(self) -> TlsFiles | None:
        """This launch's TLS files (made on first use), None when launch.tls is off."""
        if not self.mode:
            return None
        if self._files is None:
            pki = make_pki(self.run_dir / "tls", _local_names())
            self._files = TlsFiles(cert_file=pki.cert_file, key_file=pki.key_file, ca_file=pki.ca_file,
                                   client_ca_file=pki.ca_file if self.mode == "mutual" else None)
            # This process calls the services (the readiness checks, the controller's run) with it.
            adopt(self._files)
        return self._files

    def section(self) -> dict[str, Any]:
        """`{"server": {"tls": ...}}` for a service's config; empty when launch.tls is off."""
        files = self.files()
        if files is None:
            return {}
        tls = {name: str(getattr(files, name)) for name in ("cert_file", "key_file", "client_ca_file", "ca_file")
               if getattr(files, name) is not None}
        return {"server": {"tls": tls}}
