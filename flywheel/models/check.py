"""The one check every service that loads a model makes before it serves.

A service started without a model, or pointed at a directory that holds none,
would otherwise report SERVING and fail at the first call of a run: the
message here names the setting to fix instead, before anything listens.
"""

from __future__ import annotations

from pathlib import Path

from flywheel.runtime.config import ConfigError, env_name
from flywheel.runtime.entry import env_prefix


def require_model_dir(path: Path | str | None, service: str, setting: tuple[str, ...]) -> Path:
    """`path` if it is a Hugging Face model directory, else ConfigError naming `setting`."""
    name = f"{'.'.join(setting)} (env {env_name(env_prefix(service), setting)})"
    if path is None or str(path) == "":
        raise ConfigError(f"{name} is not set: the {service} needs a Hugging Face model directory to load")
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{name} = {path}: no such directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{name} = {path}: not a Hugging Face model directory (no config.json)")
    return path
