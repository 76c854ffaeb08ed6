"""`tinker://` paths, parsed strictly: `tinker://<model id>/<kind>/<name>`, where
the model id is one this gateway makes, the kind `weights` (a named training
checkpoint) or `sampler_weights` (weights saved for the sampler), and the name
one component of letters, digits, '.', '_' and '-' that is not `.` or `..`.
Nothing else is a path here: no `..`, no absolute or empty component, no
escapes, no further components. A path names a save of the caller's tenant
only: its files lie under that tenant's directory (services/tinker/checkpoints.py),
so another tenant's path is simply not found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flywheel.errors import InvalidArgument

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
#: The ids create_model and create-via-load give: "<session id>:train:<model_seq_id>".
MODEL_ID = re.compile(r"^session-[0-9a-f]{12}:train:[0-9]{1,9}$")
#: A save's name: one path component (never "." or "..": it must start with a letter or digit).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """What the REST API calls it: "<kind>/<name>"."""
        return f"{self.kind}/{self.name}"


def check_name(name: object, what: str) -> str:
    """`name` if it is a save's name (one safe path component), else InvalidArgument naming `what`."""
    if not isinstance(name, str) or not NAME.match(name) or ".." in name:
        raise InvalidArgument(f"{what}: {name!r} must be a name of letters, digits, '.', '_', '-' (one path "
                              "component, at most 128 characters, no '..')")
    return name


def check_model_id(model_id: object, what: str) -> str:
    if not isinstance(model_id, str) or not MODEL_ID.match(model_id):
        raise InvalidArgument(f"{what}: {model_id!r} is not a model id of this gateway (session-<hex>:train:<n>)")
    return model_id


def parse_path(path: object, what: str, kinds: tuple[str, ...] = KINDS) -> TinkerPath:
    """A `tinker://<model id>/<kind>/<name>` path of one of `kinds`; InvalidArgument for anything else."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise InvalidArgument(f"{what}: {path!r} is not a tinker:// path")
    parts = path[len(SCHEME):].split("/")
    if len(parts) != 3 or any(part in ("", ".", "..") for part in parts):
        raise InvalidArgument(f"{what}: {path!r} is not tinker://<model id>/<kind>/<name> (no '..', no empty or "
                              "absolute component, nothing after the name)")
    model_id, kind, name = parts
    check_model_id(model_id, what)
    if kind not in kinds:
        raise InvalidArgument(f"{what}: {path!r}: the kind must be {' or '.join(kinds)}, not {kind!r}")
    return TinkerPath(model_id, kind, check_name(name, what))


def parse_checkpoint_id(model_id: str, checkpoint_id: str, what: str) -> TinkerPath:
    """The REST API's (training run id, "<kind>/<name>") as a path."""
    return parse_path(f"{SCHEME}{model_id}/{checkpoint_id}", what)
