"""The trainer's directories on disk: where requests may write, and atomic replacement.

Shared by checkpoints (`global_step_N/`) and CHECKPOINT exports
(`version_N/`): both write a complete directory into a hidden sibling and
make it appear under its final name at once with `replace_directory`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from services.trainer.config import TrainerConfig


def publish_dir(config: TrainerConfig) -> Path:
    """Where CHECKPOINT versions are written by default: `sync.publish_dir`, else `<checkpoint.dir>/published`."""
    return config.sync.publish_dir or config.checkpoint.dir / "published"


def request_roots(config: TrainerConfig) -> list[Path]:
    """The directories a request's paths may lie in (flywheel.runtime.paths.confine): the checkpoint
    directory first (a relative path is taken there), the publish directory, and any others allowed."""
    return [config.checkpoint.dir, publish_dir(config), *config.checkpoint.allowed_roots]


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_directory(tmp: Path, final: Path) -> None:
    """Makes the complete directory `tmp` appear as `final` at once, durably (a crash leaves the
    old `final` or the new one, never a mix). An existing `final` (the same step or version saved
    twice) is moved aside first, since rename cannot replace a non-empty directory."""
    _fsync_tree(tmp)
    replaced = None
    if final.exists():
        replaced = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, replaced)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
