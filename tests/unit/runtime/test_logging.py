"""Where a service's log lines go, and which ones are kept."""

from __future__ import annotations

import io
import logging

from flywheel.runtime.logging import route_root_logging


def test_per_request_client_lines_are_dropped_but_their_warnings_kept() -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, {n: logging.getLogger(n).level for n in ("httpx", "httpcore")})
    stream = io.StringIO()
    try:
        route_root_logging(logging.StreamHandler(stream), logging.INFO)
        logging.getLogger("httpx").info("HTTP Request: GET /v1/models 200")  # an agent's every call
        logging.getLogger("httpx").warning("retrying")
        logging.getLogger("flywheel.run").info("step 1 done")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)
    assert stream.getvalue().splitlines() == ["retrying", "step 1 done"]
