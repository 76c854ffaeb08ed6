"""The served model's checkpoint layout: the names, dtypes and shapes a weight
version must provide (those of the checkpoint the engine started from), and
the check that a version fits them (INVALID_ARGUMENT naming the first
differences), before anything live is touched."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from flywheel.codec import dtype_from_proto
from flywheel.codec.checkpoint_dir import header_specs, safetensors_files
from flywheel.common.v1 import common_pb2
from flywheel.errors import FailedPrecondition, InvalidArgument
from services.rollout.engine.base import TensorSpec


def file_specs(files: list[Path]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(dtype, shape) for name, (dtype, shape) in header_specs(files).items()}


def checkpoint_specs(path: Path, served: torch.dtype | None = None) -> dict[str, TensorSpec]:
    """Names, dtypes and shapes of every tensor of a safetensors directory; `served`: the dtype the engine
    was told to hold its floating tensors in (engine.args.dtype), which a version must then bring."""
    specs = file_specs(safetensors_files(Path(path)))
    if served is None:
        return specs
    return {n: TensorSpec(served, s.shape) if s.dtype.is_floating_point else s for n, s in specs.items()}


def _short(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def verify_specs(got: Mapping[str, TensorSpec], want: Mapping[str, TensorSpec], what: str) -> None:
    """InvalidArgument naming the first differences between `got` and the served model's `want`."""
    missing = [n for n in want if n not in got]
    extra = [n for n in got if n not in want]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unknown to the model {', '.join(map(repr, extra[:5]))}{' ...' if len(extra) > 5 else ''}")
    for name, spec in want.items():
        have = got.get(name)
        if have is None:
            continue
        if have.shape != spec.shape:
            problems.append(f"tensor {name!r} has shape {list(have.shape)}, the model's is {list(spec.shape)}")
        elif have.dtype != spec.dtype:
            problems.append(f"tensor {name!r} has dtype {_short(have.dtype)}, the model's is {_short(spec.dtype)}")
        if len(problems) >= 5:
            break
    if problems:
        raise InvalidArgument(f"{what} does not fit the served model: {'; '.join(problems)}")


def check_stream_manifest(version: int, manifest: common_pb2.WeightManifest, want: Mapping[str, TensorSpec]) -> None:
    """Refuses a MEMORY version before any of its chunks is received: the
    wrong version, a delta, or names, dtypes or shapes the engine does not serve."""
    if manifest.version != version:
        raise FailedPrecondition(f"synchronizer sent version {manifest.version}, the update asked for {version}")
    if manifest.base_version:
        raise InvalidArgument(f"delta versions (base {manifest.base_version}) are not supported; send full weights")
    got = {m.name: TensorSpec(dtype_from_proto(m.dtype), tuple(m.shape)) for m in manifest.tensors}
    verify_specs(got, want, f"weight version {version}")
