"""The runtime image as the Dockerfile builds it, for the harness that plays it:
the user it runs as (USER), the directories it creates and who owns them, and
where its user's home is. Read from the Dockerfile's final stage, so that a
change there changes what the deployment tests run with.

    image_user("cpu")          # Identity(uid=10001, gid=10001)
    image_directories("cpu")   # {"/data": Ownership(10001, 10001, 0o755), ...}

What a named volume starts as depends on it (Docker copies the image's
directory at the mount path, ownership included, into a new volume), and so
does whether the image's user can write there.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.manifests import ROOT

DOCKERFILE = ROOT / "Dockerfile"
#: `mkdir` and `useradd --create-home` under the build's umask (022); COPY'd directories keep 0755.
DIRECTORY_MODE = 0o755


@dataclass(frozen=True)
class Ownership:
    uid: int
    gid: int
    mode: int


@dataclass(frozen=True)
class Identity:
    """Who a container's processes run as, with what they may still gain."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()  # supplementary groups
    no_new_privs: bool = False  # allowPrivilegeEscalation: false
    drop_capabilities: bool = False  # capabilities.drop: [ALL]

    def setpriv(self) -> list[str]:
        """The util-linux setpriv command that becomes this identity and execs what follows."""
        argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"]
        if self.no_new_privs:
            argv.append("--no-new-privs")
        if self.drop_capabilities:
            argv += ["--bounding-set=-all", "--inh-caps=-all"]
        return [*argv, "--"]


def stage(name: str, dockerfile: Path = DOCKERFILE) -> list[str]:
    """The instructions of stage `name` (continuation lines joined, comments dropped)."""
    lines, current = [], ""
    for raw in dockerfile.read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue
        current += raw.rstrip().removesuffix("\\") + (" " if raw.rstrip().endswith("\\") else "")
        if not raw.rstrip().endswith("\\"):
            if current.strip():
                lines.append(current.strip())
            current = ""
    found, inside = [], False
    for line in lines:
        if line.upper().startswith("FROM "):
            inside = bool(re.search(rf"\s+AS\s+{re.escape(name)}$", line, re.IGNORECASE))
            continue
        if inside:
            found.append(line)
    assert found, f"{dockerfile}: no stage {name}"
    return found


def image_user(target: str) -> Identity:
    """USER of the stage: numeric uid[:gid] (as Kubernetes' runAsNonRoot needs)."""
    users = [line.split(None, 1)[1] for line in stage(target) if line.upper().startswith("USER ")]
    assert users, f"Dockerfile stage {target} sets no USER: its processes would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and (not gid or gid.isdigit()), f"USER {users[-1]}: not numeric"
    return Identity(int(uid), int(gid or uid))


def _commands(run: str) -> list[list[str]]:
    """A RUN line's shell commands, split at && and ;."""
    return [shlex.split(part) for part in re.split(r"&&|;", run.split(None, 1)[1]) if part.strip()]


def image_directories(target: str) -> dict[str, Ownership]:
    """Directories the stage creates or copies, path -> ownership: `mkdir` (root), `chown`
    (its owner), `useradd --create-home --home-dir` (the new user and its group) and the
    targets of COPY (root; --chown is honoured)."""
    found: dict[str, Ownership] = {}
    for line in stage(target):
        keyword = line.split(None, 1)[0].upper()
        if keyword == "COPY":
            args = shlex.split(line)[1:]
            if not any(a.startswith("--from=") for a in args) and (ROOT / args[-2]).is_file():
                continue  # a file, not a directory a volume could start from
            owner = next((a.split("=", 1)[1] for a in args if a.startswith("--chown=")), "0:0")
            uid, _, gid = owner.partition(":")
            found[args[-1].rstrip("/")] = Ownership(int(uid), int(gid or uid), DIRECTORY_MODE)
        if keyword != "RUN":
            continue
        for argv in _commands(line):
            if argv[:1] == ["mkdir"]:
                for path in (a for a in argv[1:] if not a.startswith("-")):
                    found.setdefault(path, Ownership(0, 0, DIRECTORY_MODE))
            elif argv[:1] == ["chown"]:
                operands = [a for a in argv[1:] if not a.startswith("-")]
                uid, _, gid = operands[0].partition(":")
                for path in operands[1:]:
                    mode = found.get(path, Ownership(0, 0, DIRECTORY_MODE)).mode
                    found[path] = Ownership(int(uid), int(gid or uid), mode)
            elif argv[:1] == ["useradd"] and "--create-home" in argv:
                uid = int(argv[argv.index("--uid") + 1])
                found[argv[argv.index("--home-dir") + 1]] = Ownership(uid, uid, DIRECTORY_MODE)
    return found


def image_workdir(target: str) -> str:
    """WORKDIR of the stage: where the containers start."""
    workdirs = [line.split(None, 1)[1] for line in stage(target) if line.upper().startswith("WORKDIR ")]
    assert workdirs, f"Dockerfile stage {target} sets no WORKDIR"
    return workdirs[-1]


def image_home(target: str) -> str:
    """The home directory `useradd` gives the image's user: its HOME (Docker reads it from /etc/passwd)."""
    for line in stage(target):
        for argv in _commands(line) if line.upper().startswith("RUN ") else []:
            if argv[:1] == ["useradd"] and int(argv[argv.index("--uid") + 1]) == image_user(target).uid:
                return argv[argv.index("--home-dir") + 1]
    raise AssertionError(f"Dockerfile stage {target}: no useradd for its USER")


def image_target(reference: str) -> str:
    """The Dockerfile stage an image reference names by its tag's suffix (flywheel:0.1.0-cpu: cpu)."""
    match = re.search(r"-(cpu|gpu)$", reference)
    assert match, f"image {reference}: not one this repository builds (a tag ending -cpu or -gpu)"
    return match.group(1)
