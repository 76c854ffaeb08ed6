"""Typed configuration with layered sources: defaults < file < env < CLI.

Each service declares one pydantic model (fields documented with
`Field(description=...)`, `extra="forbid"` everywhere). `load_config` builds
an argparse parser from that model (one `--section.field` flag per leaf), reads
an optional `--config FILE` (YAML or JSON), environment variables named
`<PREFIX><SECTION>__<FIELD>` and the command line, merges them in that order
and validates once. Any unknown or ill-typed field — in the file, in an env
variable carrying the prefix, or on the command line — is a `ConfigError`
whose message names the field and where its value came from.
"""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

M = TypeVar("M", bound=BaseModel)

ENV_SEPARATOR = "__"


class ConfigError(ValueError):
    """A configuration value is unknown or invalid; the message names it."""


class StrictModel(BaseModel):
    """Base for config sections: unknown fields are errors, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def checkpoint_root_field(paths: str, refused: str) -> Any:
    """The `checkpoint_root` setting of a service that reads CHECKPOINT versions (the rollout, the
    synchronizer): every path it is given is confined to that directory (flywheel.runtime.paths.confine).
    `paths` names the paths it is given, `refused` what it refuses without a root."""
    return Field(
        None, description=f"the shared directory CHECKPOINT versions are published in: {paths} must lie inside it "
        f"(PERMISSION_DENIED otherwise; a relative one is taken there); none: CHECKPOINT {refused} are refused"
    )


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class behind an annotation (also inside Optional), if any."""
    candidates = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_structured(annotation: Any) -> bool:
    """Whether a leaf's text value must be parsed as YAML (dicts, lists)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_is_structured(a) for a in typing.get_args(annotation) if a is not type(None))
    return origin in (dict, list, tuple, set, Mapping, Sequence) or annotation in (dict, list)


def leaf_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf field of a model as {path: annotation}; sub-models are walked."""
    leaves: dict[tuple[str, ...], Any] = {}
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        sub = submodel(field.annotation)
        if sub is not None:
            leaves.update(leaf_fields(sub, path))
        else:
            leaves[path] = field
    return leaves


def env_name(prefix: str, path: Sequence[str]) -> str:
    """The environment variable that sets a field, e.g. FLYWHEEL_TRAINER__SERVER__PORT."""
    return prefix + ENV_SEPARATOR.join(p.upper() for p in path)


def cli_flag(path: Sequence[str]) -> str:
    return "--" + ".".join(p.replace("_", "-") for p in path)


def _set_path(target: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{'.'.join(path)}: cannot set a field inside a non-mapping value")
    target[path[-1]] = value


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Merges override into base (nested mappings merged, everything else replaced)."""
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value
    return base


def _parse_text(text: str, structured: bool, origin: str) -> Any:
    if not structured:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: not valid YAML/JSON: {exc}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: cannot parse: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping, got {type(data).__name__}")
    return data


def env_overrides(model: type[BaseModel], env: Mapping[str, str], prefix: str) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """Values from env variables carrying the prefix; unknown names are errors."""
    leaves = leaf_fields(model)
    by_name = {env_name(prefix, path): path for path in leaves}
    values: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    for name, text in env.items():
        if not name.startswith(prefix):
            continue
        path = by_name.get(name)
        if path is None:
            known = ", ".join(sorted(by_name))
            raise ConfigError(f"environment variable {name} names no configuration field (known: {known})")
        origin = f"env {name}"
        _set_path(values, path, _parse_text(text, _is_structured(leaves[path].annotation), origin))
        origins[path] = origin
    return values, origins


def build_parser(
    model: type[BaseModel], prog: str, description: str, env_prefix: str, section: str | None = None
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"Every flag can also be set in --config FILE or as an env variable {env_prefix}<SECTION>__<FIELD>.",
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="YAML or JSON file with any of the fields below")
    if section is not None:
        parser.add_argument(
            "--run-file", type=Path,
            help=f"a run file (examples/*.yaml): its launch.{section} section gives this service the settings the "
            f"local launcher would (below --config, env and flags); deployments point every service at one file",
        )
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration as JSON and exit")
    for path, field in leaf_fields(model).items():
        default = field.get_default(call_default_factory=True)
        shown = "***" if isinstance(default, SecretStr) else default
        parser.add_argument(
            cli_flag(path),
            dest=".".join(path),
            metavar=path[-1].upper(),
            # argparse formats help with %, so a literal "%" in a description must be doubled.
            help=f"{field.description or ''} (default: {shown!r}; env {env_name(env_prefix, path)})".replace("%", "%%"),
        )
    return parser


def _paths(data: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key path in nested mappings (sections and leaves)."""
    found = []
    for key, value in data.items():
        path = (*prefix, str(key))
        found.append(path)
        if isinstance(value, Mapping):
            found.extend(_paths(value, path))
    return found


def _format_validation_error(exc: ValidationError, origins: Mapping[tuple[str, ...], str]) -> str:
    lines = []
    for err in exc.errors():
        path = tuple(str(p) for p in err["loc"])
        # The value's own origin, else that of the nearest enclosing section.
        where = next((origins[path[:n]] for n in range(len(path), 0, -1) if path[:n] in origins), "")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        else:
            msg = err["msg"]
        value = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
        suffix = f" [from {where}]" if where else ""
        lines.append(f"{'.'.join(path)}: {msg}{value}{suffix}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def resolve(
    model: type[M],
    *,
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str,
    cli: Mapping[str, str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> M:
    """Merges defaults < base < file < env < CLI (flag name -> text) and validates.
    `base` is a caller's own defaults (e.g. the launcher's section of a run file)."""
    data: dict[str, Any] = deep_merge({}, base or {})
    origins: dict[tuple[str, ...], str] = {path: "run file" for path in _paths(base or {})}
    if file is not None:
        file_data = read_config_file(file)
        deep_merge(data, file_data)
        for path in _paths(file_data):
            origins[path] = f"file {file}"
    env_data, env_origins = env_overrides(model, os.environ if env is None else env, env_prefix)
    deep_merge(data, env_data)
    origins.update(env_origins)
    leaves = leaf_fields(model)
    cli_data: dict[str, Any] = {}
    for dotted, text in (cli or {}).items():
        path = tuple(dotted.split("."))
        if path not in leaves:
            raise ConfigError(f"{cli_flag(path)}: names no configuration field")
        origin = f"flag {cli_flag(path)}"
        _set_path(cli_data, path, _parse_text(text, _is_structured(leaves[path].annotation), origin))
        origins[path] = origin
    deep_merge(data, cli_data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origins)) from None


def load_config(
    model: type[M],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    env_prefix: str,
    env: Mapping[str, str] | None = None,
    section: str | None = None,
) -> M:
    """Parses the command line and resolves the config; exits with a message on error.
    `section`: the service's name in a run file's `launch:` (enables --run-file)."""
    parser = build_parser(model, prog, description, env_prefix, section)
    namespace = vars(parser.parse_args(argv))
    file = namespace.pop("config", None)
    run_file = namespace.pop("run_file", None)
    print_only = namespace.pop("print_config", False)
    try:
        base = run_file_section(run_file, section) if run_file is not None and section else None
        config = resolve(model, file=file, env=env, env_prefix=env_prefix, cli=namespace, base=base)
    except ConfigError as exc:
        parser.exit(2, f"{prog}: {exc}\n")
    if print_only:
        print(json.dumps(redacted(config), indent=2))
        parser.exit(0)
    return config


def run_file_section(path: Path, section: str) -> dict[str, Any]:
    """`launch.<section>` of a run file: what the local launcher would give that service."""
    data = read_config_file(path)
    launch = data.get("launch") or {}
    if not isinstance(launch, Mapping):
        raise ConfigError(f"run file {path}: launch: must be a mapping")
    value = launch.get(section) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"run file {path}: launch.{section}: must be a mapping")
    run = data.get("run") or {}
    model = launch.get("model") or {}
    return with_run_defaults(section, dict(value), run if isinstance(run, Mapping) else {},
                             model if isinstance(model, Mapping) else {})


def with_run_defaults(section: str, values: dict[str, Any], run: Mapping[str, Any],
                      model: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A service's `launch.<section>` with what the run file's `run:` and `launch.model` imply for it,
    so each is named once. The local launcher and a deployed service's --run-file both take the
    section through here.
    - The trainer: a decaying learning rate (optimizer.schedule linear or cosine) with no total_steps
      decays over run.max_steps, as TRL's does over its max_steps, and a longer run does not train
      its last steps at a rate already at the floor.
    - The trainer and the rollout: `launch.model.serve_dtype` (`served_dtype`)."""
    optimizer = values.get("optimizer")
    max_steps = run.get("max_steps")
    if (section == "trainer" and isinstance(optimizer, Mapping) and max_steps
            and optimizer.get("schedule", "constant") != "constant" and not optimizer.get("total_steps")):
        values = {**values, "optimizer": {**optimizer, "total_steps": int(max_steps)}}
    return with_served_dtype(section, values, (model or {}).get("serve_dtype", "same"))


#: Where each service takes the dtype the rollout computes in: the trainer publishes its versions cast
#: to it (it trains in its own model.dtype), the rollout's engine holds the weights in it.
_SERVED_DTYPE_FIELDS = {"trainer": ("model", "publish_dtype"), "rollout": ("engine", "args", "dtype")}


def served_dtype(serve: str) -> str | None:
    """`launch.model.serve_dtype` on this machine: bfloat16, or None where the stored dtype is served
    (same; auto where the machine has no native bfloat16: flywheel.models.precision)."""
    if serve not in ("same", "auto", "bfloat16"):
        raise ConfigError(f"launch.model.serve_dtype: same, auto or bfloat16, not {serve!r}")
    if serve == "auto":
        import torch

        from flywheel.models.precision import native_bfloat16

        return "bfloat16" if native_bfloat16("cuda" if torch.cuda.is_available() else "cpu") else None
    return None if serve == "same" else serve


def with_served_dtype(section: str, values: dict[str, Any], serve: str) -> dict[str, Any]:
    """The trainer's or the rollout's section with the served dtype in its field; a field that says
    otherwise is refused (the rollout would refuse every version)."""
    served = served_dtype(serve)
    path = _SERVED_DTYPE_FIELDS.get(section)
    if served is None or path is None:
        return values
    said: Any = values
    for key in path:
        said = said.get(key) if isinstance(said, Mapping) else None
    if said is not None and said != served:
        raise ConfigError(f"launch.{section}.{'.'.join(path)} {said} disagrees with launch.model.serve_dtype "
                          f"{serve} ({served} on this machine): set the one, launch.model.serve_dtype")
    setting: dict[str, Any] = {path[-1]: served}
    for key in reversed(path[:-1]):
        setting = {key: setting}
    return deep_merge(values, setting)


def redacted(config: BaseModel) -> dict[str, Any]:
    """The config as JSON-able data with secrets masked, for logs."""
    return config.model_dump(mode="json")
