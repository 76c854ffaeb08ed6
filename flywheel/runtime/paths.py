"""Paths that arrive over the wire, confined to the directories a service was
configured with.

A request may name a checkpoint to write or load, a directory to publish
weights into, or a version to register; a caller holding a token must not
be able to make a service write or read anywhere else on its disk. Every
such path goes through `confine` before anything touches it:

- it must be text a file system can hold: no NUL byte, no name over
  NAME_MAX bytes, no path over PATH_MAX (INVALID_ARGUMENT);
- a relative path is taken inside the first root;
- `..` and symbolic links are resolved first, so neither can lead out; what
  is left must lie inside one of the roots (PERMISSION_DENIED otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from flywheel.errors import FailedPrecondition, InvalidArgument, PermissionDenied

#: Longest single name and whole path Linux file systems take (NAME_MAX, PATH_MAX), in bytes.
NAME_MAX = 255
PATH_MAX = 4096


def confine(requested: str | os.PathLike[str], roots: Sequence[Path], field: str) -> Path:
    """`requested` resolved, if it lies inside one of `roots`; the error names `field` and the roots otherwise."""
    text = os.fspath(requested)
    check_text(text, field)
    if not roots:
        raise FailedPrecondition(
            f"{field}: this service accepts no paths from requests (no directory is configured for them)"
        )
    homes = [Path(os.path.realpath(root)) for root in roots]
    resolved = Path(os.path.realpath(homes[0] / text))  # an absolute `text` replaces the root here
    if not any(resolved.is_relative_to(home) for home in homes):
        allowed = ", ".join(str(home) for home in homes)
        raise PermissionDenied(f"{field}: {text!r} is outside the directories this service may use ({allowed})")
    return resolved


def check_text(text: str, field: str) -> None:
    """INVALID_ARGUMENT for a path no file system could hold."""
    if "\0" in text:
        raise InvalidArgument(f"{field}: contains a NUL byte")
    encoded = os.fsencode(text)
    if len(encoded) > PATH_MAX:
        raise InvalidArgument(f"{field}: {len(encoded)} bytes long, more than the {PATH_MAX} a path may have")
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if longest > NAME_MAX:
        raise InvalidArgument(f"{field}: has a name of {longest} bytes, more than the {NAME_MAX} a name may have")
