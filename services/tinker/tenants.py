"""Who calls the Tinker API: the tenant whose key the SDK sends (`X-API-Key`).

A tenant key (`python -m flywheel.runtime.tokens tenant add NAME`) opens the
Tinker API and nothing else: every other service knows it as scope `tenant`
and refuses it (PERMISSION_DENIED), and the gateway alone calls the trainer
and the rollout, with its own service token. Here only tenant keys are
admitted: a staff token (viewer ... operator) is the services' own and is
refused with 403, no key or an unknown one with 401.

Every session, model, checkpoint, sampler and request a tenant makes is its
own: another tenant gets 404 for it, by id and by path. The tokens file is
read again when it changes (checked at most once a second), so a revoked key
is refused from then on and a new one admitted without a restart.

Without any token configured (local development, `flywheel up` without a
tokens file) every key is accepted as the one tenant `local`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from flywheel.errors import FlywheelError, PermissionDenied, Unauthenticated
from flywheel.runtime.auth import TokenScopes, parse_tokens_file
from services.tinker import metrics

log = logging.getLogger(__name__)

#: The tenant of every key when no token is configured.
LOCAL = "local"
#: How often the tokens file is looked at for changes, in seconds.
RELOAD_SECONDS = 1.0


class TenantKeys:
    """The keys the Tinker API admits, each its tenant's (see the module doc)."""

    def __init__(self, tokens: TokenScopes, path: Path | None = None) -> None:
        self._tokens = tokens
        self._path = path
        self._stamp = self._stat()
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int, int] | None:
        if self._path is None:
            return None
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _current(self) -> TokenScopes:
        now = time.monotonic()
        if self._path is None or now - self._checked < RELOAD_SECONDS:
            return self._tokens
        self._checked = now
        stamp = self._stat()
        if stamp != self._stamp and stamp is not None:
            try:
                _, tenants = parse_tokens_file(self._path.read_text(), self._path)
            except (OSError, FlywheelError) as exc:  # a file being rewritten by hand: keep the keys known
                log.warning("tokens file not re-read; the tenant keys read before stay", extra={"error": str(exc)})
            else:
                self._tokens = TokenScopes(self._tokens.headers, TokenScopes.of({}, tenants).tenant_headers)
                log.info("tenant keys re-read", extra={"tenants": len(tenants)})
            self._stamp = stamp
        return self._tokens

    def tenant(self, key: str | None, what: str) -> str:
        """The tenant whose key `key` is (counted as a use of its key); Unauthenticated for no key or
        an unknown one, PermissionDenied for a token that is not a tenant key."""
        tokens = self._current()
        if not tokens:
            tenant = LOCAL
        else:
            header = f"Bearer {key}" if key else None
            found = tokens.tenant_of(header)
            if found is None:
                held = tokens.scope_of(header)
                if held is None:
                    raise Unauthenticated("missing or unknown Tinker key (X-API-Key)")
                raise PermissionDenied(f"{what}: the Tinker API takes a tenant's key (python -m flywheel.runtime.tokens "
                                       f"tenant add NAME); this is a {held} token, which only the services use")
            tenant = found
        metrics.TENANT_REQUESTS.labels(tenant).inc()
        return tenant
