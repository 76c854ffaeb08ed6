"""The error reporter: every error a run meets, recorded, and the stop policy.

Components call `report(module, error, severity=..., context=...)` instead of
logging and carrying on; each record keeps the module, severity
("warning" | "error" | "critical"), message, context (task id, replica...),
traceback and time. The policy decides which records stop the run:

- `stop_on_error`: any error or critical;
- `stop_on_critical` (default): only critical ones (a dead trainer, no
  rollout replica left, a failed weight update in sync mode);
- `continue`: never (errors are only recorded).

The main loop checks `should_stop` between steps and awaits `stopped` to
interrupt a wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback as tb
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

Severity = Literal["warning", "error", "critical"]
_RANK = {"warning": 0, "error": 1, "critical": 2}
_STOPS_AT = {"stop_on_error": 1, "stop_on_critical": 2, "continue": 3}


@dataclass(frozen=True)
class ErrorRecord:
    module: str
    severity: Severity
    message: str
    context: dict[str, Any] = field(default_factory=dict)
    traceback: str = ""
    unix_ms: int = 0


class RunStopped(Exception):
    """The error policy stopped the run; the message names the error that did."""


class ErrorReporter:
    def __init__(self, policy: str = "stop_on_critical", max_recorded: int = 1000) -> None:
        if policy not in _STOPS_AT:
            raise ValueError(f"unknown error policy {policy!r}: {sorted(_STOPS_AT)}")
        self.policy = policy
        self.records: deque[ErrorRecord] = deque(maxlen=max_recorded)
        self.counts: dict[str, int] = {s: 0 for s in _RANK}
        self.stop_reason: str | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def stopped(self) -> asyncio.Event:
        # Created lazily so the reporter can be built outside an event loop.
        if self._stopped is None:
            self._stopped = asyncio.Event()
            if self.stop_reason is not None:
                self._stopped.set()
        return self._stopped

    @property
    def should_stop(self) -> bool:
        return self.stop_reason is not None

    def report(
        self,
        module: str,
        error: BaseException | str,
        *,
        severity: Severity = "error",
        context: Mapping[str, Any] | None = None,
        traceback: str | None = None,
    ) -> ErrorRecord:
        if isinstance(error, BaseException):
            message = f"{type(error).__name__}: {error}"
            trace = traceback or "".join(tb.format_exception(type(error), error, error.__traceback__))
        else:
            message, trace = error, traceback or ""
        record = ErrorRecord(module, severity, message, dict(context or {}), trace, int(time.time() * 1000))
        self.records.append(record)
        self.counts[severity] += 1
        log.log(
            logging.WARNING if severity == "warning" else logging.ERROR,
            "%s %s: %s",
            module,
            severity,
            message,
            extra={"context": record.context},
        )
        if _RANK[severity] >= _STOPS_AT[self.policy] and self.stop_reason is None:
            self.stop_reason = f"{module} {severity}: {message}"
            self.stopped.set()
        return record

    def raise_if_stopped(self) -> None:
        if self.stop_reason is not None:
            raise RunStopped(self.stop_reason)

    def recent(self, n: int = 20) -> list[ErrorRecord]:
        return list(self.records)[-n:]
