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

import math
from collections.abc import Mapping
from pathlib import Path

from flywheel.codec import encode_state_dict
from flywheel.codec.checkpoint_dir import read_tensors, safetensors_files
from flywheel.codec.identity import VersionIdentity, identify, manifest_identity
from flywheel.common.v1 import common_pb2
from flywheel.errors import DataLoss, FailedPrecondition
from flywheel.probe import ProbeBatch
from services.rollout.engine.base import StagedWeights, TensorSpec
from services.rollout.engine.checkpoint import file_specs, verify_specs

#: Optional file in a checkpoint directory: a serialized WeightManifest of its tensors.
MANIFEST_FILE = "weight_manifest.pb"


def stage_checkpoint(path: Path, version: int, want: Mapping[str, TensorSpec]) -> StagedWeights:
    """Verifies a checkpoint directory (blocking; run it in a thread). Its identity: the manifest's,
    once the files were checked against it; without a manifest (a model directory, an operator's
    checkpoint), measured here on the files' own bytes."""
    files = safetensors_files(Path(path))
    specs = file_specs(files)
    verify_specs(specs, want, f"checkpoint {str(path)!r}")
    manifest_path = Path(path) / MANIFEST_FILE
    if manifest_path.exists():
        identity, probe = _verify_manifest(manifest_path, files, version)
    else:
        identity, probe = identify(read_tensors(files)), None
    nbytes = sum(s.dtype.itemsize * math.prod(s.shape) for s in specs.values())
    return StagedWeights(version=version, files=[str(f) for f in files], nbytes=nbytes, identity=identity,
                         probe=probe)


def _verify_manifest(manifest_path: Path, files: list[Path], version: int) -> tuple[VersionIdentity, ProbeBatch | None]:
    """Re-encodes the tensors the way the manifest says and compares digests; the version's identity
    (measured on the files) and the probe the manifest carries."""
    try:
        manifest = common_pb2.WeightManifest.FromString(manifest_path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and OSError
        raise DataLoss(f"{manifest_path.name}: unreadable: {exc}") from None
    if manifest.version != version:
        raise FailedPrecondition(f"{manifest_path.name} describes version {manifest.version}, the update is {version}")
    tensors = read_tensors(files)
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
    identity = manifest_identity(encoded.manifest)
    assert identity is not None  # the encoder always computes it
    try:
        probe = ProbeBatch.from_pb(manifest.probe)
    except ValueError as exc:
        raise DataLoss(f"{manifest_path.name}: malformed probe: {exc}") from None
    return identity, probe
