"""Staging and verification of weight updates, before anything live is touched.

A weight version arrives from a CHECKPOINT directory (safetensors files,
optionally with `weight_manifest.pb`, a serialized `WeightManifest` whose
digest binds every byte) or from the synchronizer's MEMORY stream (a manifest
then checksummed chunks, assembled by `flywheel.codec`). Either way it is
checked here against the names, dtypes and shapes the engine serves (those of
the checkpoint it started from), and only a version that passes everything
becomes `StagedWeights` for the engine to swap in. Errors carry gRPC codes:
INVALID_ARGUMENT for a wrong name/dtype/shape, DATA_LOSS for corrupt bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from flywheel.codec import dtype_from_proto, encode_state_dict
from flywheel.codec.identity import VersionIdentity, manifest_identity
from flywheel.common.v1 import common_pb2
from flywheel.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from services.rollout.engine.base import StagedWeights, TensorSpec

#: Optional file in a checkpoint directory: a serialized WeightManifest of its tensors.
MANIFEST_FILE = "weight_manifest.pb"

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _short(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


def safetensors_files(path: Path) -> list[Path]:
    if not path.is_dir():
        raise NotFound(f"checkpoint path {str(path)!r} is not a directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NotFound(f"checkpoint path {str(path)!r} holds no *.safetensors file")
    return files


def _header(file: Path) -> dict:
    """The JSON header of a safetensors file (read without loading any tensor)."""
    try:
        with open(file, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > 100 * 2**20:
                raise DataLoss(f"{file.name}: safetensors header of {length} bytes is implausible")
            header = json.loads(fh.read(length))
        size = file.stat().st_size
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataLoss(f"{file.name}: unreadable safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    end = max((meta["data_offsets"][1] for meta in header.values()), default=0)
    if 8 + length + end > size:
        raise DataLoss(f"{file.name}: truncated ({size} bytes, its header needs {8 + length + end})")
    return header


def file_specs(files: list[Path]) -> dict[str, TensorSpec]:
    specs: dict[str, TensorSpec] = {}
    for file in files:
        for name, meta in _header(file).items():
            if name in specs:
                raise InvalidArgument(f"tensor {name!r} appears in more than one file of the checkpoint")
            dtype = _ST_DTYPES.get(meta.get("dtype"))
            if dtype is None:
                raise InvalidArgument(f"{file.name}: tensor {name!r} has unsupported dtype {meta.get('dtype')!r}")
            specs[name] = TensorSpec(dtype, tuple(meta["shape"]))
    return specs


def checkpoint_specs(path: Path) -> dict[str, TensorSpec]:
    """Names, dtypes and shapes of every tensor of a safetensors directory."""
    return file_specs(safetensors_files(Path(path)))


def read_files(files: list[str] | list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise DataLoss(f"{Path(file).name}: cannot read: {exc}") from None
    return tensors


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


def stage_checkpoint(path: Path, version: int, want: Mapping[str, TensorSpec]) -> StagedWeights:
    """Verifies a checkpoint directory (blocking; run it in a thread)."""
    files = safetensors_files(Path(path))
    specs = file_specs(files)
    verify_specs(specs, want, f"checkpoint {str(path)!r}")
    manifest_path = Path(path) / MANIFEST_FILE
    identity = _verify_manifest(manifest_path, files, version) if manifest_path.exists() else None
    nbytes = sum(s.dtype.itemsize * _numel(s.shape) for s in specs.values())
    return StagedWeights(version=version, files=[str(f) for f in files], nbytes=nbytes, identity=identity)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _verify_manifest(manifest_path: Path, files: list[Path], version: int) -> VersionIdentity | None:
    """Re-encodes the tensors the way the manifest says and compares digests; the version's identity."""
    try:
        manifest = common_pb2.WeightManifest.FromString(manifest_path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and OSError
        raise DataLoss(f"{manifest_path.name}: unreadable: {exc}") from None
    if manifest.version != version:
        raise FailedPrecondition(f"{manifest_path.name} describes version {manifest.version}, the update is {version}")
    tensors = read_files(files)
    ordered = {}
    for meta in manifest.tensors:
        if meta.name not in tensors:
            raise DataLoss(f"{manifest_path.name} lists {meta.name!r}, which no safetensors file holds")
        ordered[meta.name] = tensors[meta.name]
    if len(ordered) != len(tensors):
        raise DataLoss(f"{manifest_path.name} lists {len(ordered)} tensors, the files hold {len(tensors)}")
    encoded = encode_state_dict(
        ordered, manifest.version, manifest.base_version,
        chunk_bytes=manifest.chunk_bytes, bucket_bytes=manifest.bucket_bytes,
    )
    if encoded.manifest.digest != manifest.digest:
        raise DataLoss(f"checkpoint bytes do not match {manifest_path.name} (digest differs): corrupt or altered")
    if manifest.identity and encoded.manifest.identity != manifest.identity:
        raise DataLoss(f"checkpoint bytes do not match {manifest_path.name} (identity differs): corrupt or altered")
    return manifest_identity(encoded.manifest)


def check_stream_manifest(version: int, manifest: common_pb2.WeightManifest, want: Mapping[str, TensorSpec]) -> None:
    """Refuses a MEMORY version before any of its chunks is received: the
    wrong version, a delta, or names, dtypes or shapes the engine does not serve."""
    if manifest.version != version:
        raise FailedPrecondition(f"synchronizer sent version {manifest.version}, the update asked for {version}")
    if manifest.base_version:
        raise InvalidArgument(f"delta versions (base {manifest.base_version}) are not supported; send full weights")
    got = {m.name: TensorSpec(dtype_from_proto(m.dtype), tuple(m.shape)) for m in manifest.tensors}
    verify_specs(got, want, f"weight version {version}")
