"""Output constraints as xgrammar structural tags, the one form the vLLM
engine hands to its structured-output backend.

Every JSON value is bounded in its runs of whitespace: xgrammar's default
allows unbounded whitespace between tokens, and a model that drifts into
spaces (an untrained one always does) then fills max_tokens with them
instead of finishing the JSON. Four allows pretty-printed JSON one level deep.
"""

from __future__ import annotations

import json
from typing import Any

from flywheel.common.types import OutputConstraint

MAX_WHITESPACE_RUN = 4


def json_value(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """A format element: one JSON value valid for `schema`."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE_RUN}


def structural(fmt: dict[str, Any]) -> OutputConstraint:
    """The whole output must match the format element `fmt`."""
    return OutputConstraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))
