"""Structured logging: one JSON object per line (or plain text for humans).

`extra={...}` fields passed to a logging call become keys of the JSON object,
so `log.info("weights committed", extra={"version": 7})` is queryable.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD_ATTRS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = {k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS and not k.startswith("_")}
        return f"{line} {extras}" if extras else line


#: HTTP clients that log every request at INFO: an external agent's openai SDK
#: calls (run inside the controller) would bury the run's own lines.
PER_REQUEST_LOGGERS = ("httpx", "httpx2", "httpcore")


def route_root_logging(handler: logging.Handler, level: str | int) -> None:
    """All logging to `handler` at `level`, per-request client logs at WARNING and up (idempotent)."""
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(max(root.level, logging.WARNING))


def configure_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    """Routes all logging to stderr in the chosen format (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    route_root_logging(handler, level)
