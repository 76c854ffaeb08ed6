"""Volumes with the ownership and modes Docker and the kubelet give them, so
that what the container's user may read and write is what it may on a real
host (the harness runs every process as that user: cluster.py).

Docker (named volumes): a new volume is initialised from the image's directory
at its mount path, contents and ownership; where the image has none it is
root's, 0755. A tmpfs volume (driver_opts type tmpfs) takes uid/gid/mode from
its `o` options. Bind mounts keep the host's ownership.

Kubernetes: an emptyDir is 0777; a fresh PersistentVolumeClaim is root's, 0755
(a new filesystem's root); configMap and secret files get `defaultMode` (or
the item's `mode`), 0644 unless set, and are root's. With the pod's fsGroup
the kubelet then gives the volume to that group (pkg/volume SetVolumeOwnership):
every file and directory gets group fsGroup, files `| 0660` (`| 0440` for the
read-only configMap and secret), directories also `| 0110` and setgid, so that
what the pod's processes create stays in the group.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from tests.deploy.image import Ownership

ROOT_DIRECTORY = Ownership(0, 0, 0o755)
EMPTY_DIR = Ownership(0, 0, 0o777)


def make_directory(path: Path, ownership: Ownership) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, ownership.uid, ownership.gid)
    os.chmod(path, ownership.mode)
    return path


def docker_named_volume(path: Path, image_directory: Ownership | None, image_content: Path | None = None) -> None:
    """A new named volume, as Docker fills it from the image at first mount."""
    if image_content is not None and image_content.is_dir():
        shutil.copytree(image_content, path, dirs_exist_ok=True)
    make_directory(path, image_directory or ROOT_DIRECTORY)


def docker_tmpfs_options(options: str) -> Ownership | None:
    """uid/gid/mode of a tmpfs volume's `o` (size only sizes it); None without any of them."""
    found: dict[str, str] = {}
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        assert key in ("size", "uid", "gid", "mode"), f"tmpfs option {key} is not played by the harness"
        found[key] = value
    if not {"uid", "gid", "mode"} & set(found):
        return None
    return Ownership(int(found.get("uid", 0)), int(found.get("gid", 0)), int(found.get("mode", "1777"), 8))


def write_key_files(directory: Path, files: dict[str, tuple[str, int]]) -> None:
    """A configMap or secret volume: relative path -> (content, mode), root's."""
    make_directory(directory, ROOT_DIRECTORY)
    for relative, (content, mode) in files.items():
        target = directory / relative
        for parent in reversed(target.relative_to(directory).parents[:-1]):
            make_directory(directory / parent, ROOT_DIRECTORY)
        target.write_text(content)
        os.chown(target, 0, 0)
        os.chmod(target, mode)


def apply_fs_group(path: Path, fs_group: int, read_only: bool) -> None:
    """The kubelet's SetVolumeOwnership: group fsGroup on everything, group access, setgid directories."""
    mask = 0o440 if read_only else 0o660
    for directory, subdirectories, files in os.walk(path):
        for entry in [Path(directory), *(Path(directory) / f for f in files)]:
            try:  # a claim another pod is writing to: files may go while this walks
                info = entry.lstat()
                if stat.S_ISLNK(info.st_mode):
                    continue
                os.lchown(entry, -1, fs_group)
                extra = mask | (0o110 | stat.S_ISGID if stat.S_ISDIR(info.st_mode) else 0)
                os.chmod(entry, stat.S_IMODE(info.st_mode) | extra)
            except FileNotFoundError:
                continue
