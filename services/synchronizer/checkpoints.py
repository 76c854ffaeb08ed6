"""CHECKPOINT method: checks that a registered safetensors directory is whole.

A trainer writes a directory atomically (temp dir + rename) and registers
version + path; before announcing it to rollouts the synchronizer checks,
without loading any tensor, that:
  * the directory exists and holds *.safetensors files;
  * every file's header parses and the file is as long as the header says
    (a truncated copy fails here);
  * `model.safetensors.index.json`, if present, names only existing files
    and every tensor it maps is in its file;
  * `weight_manifest.pb` (a serialized WeightManifest), if present (or
    required), is for this version and lists exactly the tensors, dtypes and
    shapes of the files; with `verify_digest`, the bytes are also re-hashed
    and compared with the manifest's digest (reads the whole checkpoint).
Blocking file I/O: run `verify_checkpoint` in a thread.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from flywheel.common.v1 import common_pb2
from flywheel.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from flywheel.probe import ProbeBatch
from flywheel.synchronizer.convert import probe_from_pb
from services.synchronizer.versions import checked_digests

MANIFEST_FILE = "weight_manifest.pb"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 << 20

_D = common_pb2.DType
_ST_DTYPES = {
    "BOOL": _D.DTYPE_BOOL, "U8": _D.DTYPE_UINT8, "I8": _D.DTYPE_INT8, "I16": _D.DTYPE_INT16,
    "U16": _D.DTYPE_UINT16, "I32": _D.DTYPE_INT32, "U32": _D.DTYPE_UINT32, "I64": _D.DTYPE_INT64,
    "U64": _D.DTYPE_UINT64, "F16": _D.DTYPE_FLOAT16, "BF16": _D.DTYPE_BFLOAT16, "F32": _D.DTYPE_FLOAT32,
    "F64": _D.DTYPE_FLOAT64, "F8_E4M3": _D.DTYPE_FLOAT8_E4M3FN, "F8_E5M2": _D.DTYPE_FLOAT8_E5M2,
}


def read_header(file: Path) -> dict[str, dict]:
    """Tensor entries of a safetensors file's header; DataLoss if unreadable or truncated."""
    try:
        with open(file, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise DataLoss(f"{file}: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER_BYTES:
                raise DataLoss(f"{file}: a {length}-byte safetensors header is implausible")
            header = json.loads(fh.read(length))
        size = file.stat().st_size
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataLoss(f"{file}: unreadable safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    end = max((int(meta["data_offsets"][1]) for meta in header.values()), default=0)
    if 8 + length + end > size:
        raise DataLoss(f"{file}: truncated ({size} bytes, its header needs {8 + length + end})")
    return header


def _check_index(directory: Path, headers: dict[str, dict[str, dict]]) -> None:
    index_path = directory / INDEX_FILE
    if not index_path.exists():
        return
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataLoss(f"{index_path}: unreadable index: {exc}") from None
    for name, file in weight_map.items():
        if file not in headers:
            raise DataLoss(f"{index_path} maps {name!r} to {file!r}, which is not in the directory")
        if name not in headers[file]:
            raise DataLoss(f"{index_path} maps {name!r} to {file!r}, which does not hold it")


def _check_manifest(directory: Path, version: int, tensors: dict[str, dict], verify_digest: bool) -> None:
    path = directory / MANIFEST_FILE
    try:
        manifest = common_pb2.WeightManifest.FromString(path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and OSError alike
        raise DataLoss(f"{path}: unreadable manifest: {exc}") from None
    if manifest.version != version:
        raise FailedPrecondition(f"{path} describes version {manifest.version}, the registration says {version}")
    listed = {m.name: m for m in manifest.tensors}
    if set(listed) != set(tensors):
        missing = sorted(set(listed) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(listed))[:5]
        raise DataLoss(
            f"{path} and the safetensors files disagree: only in the manifest {missing}, only in files {extra}"
        )
    for name, meta in listed.items():
        entry = tensors[name]
        if _ST_DTYPES.get(entry["dtype"]) != meta.dtype or list(entry["shape"]) != list(meta.shape):
            raise DataLoss(
                f"tensor {name!r}: file has {entry['dtype']}{entry['shape']}, "
                f"{MANIFEST_FILE} has {common_pb2.DType.Name(meta.dtype)}{list(meta.shape)}"
            )
    if verify_digest:
        _verify_digest(directory, manifest)


def _verify_digest(directory: Path, manifest: common_pb2.WeightManifest) -> None:
    from safetensors.torch import load_file

    from flywheel.codec import encode_state_dict

    loaded: dict = {}
    for file in sorted(directory.glob("*.safetensors")):
        loaded.update(load_file(str(file)))
    ordered = {m.name: loaded[m.name] for m in manifest.tensors}
    encoded = encode_state_dict(
        ordered, manifest.version, manifest.base_version,
        chunk_bytes=manifest.chunk_bytes, bucket_bytes=manifest.bucket_bytes,
    )
    if encoded.manifest.digest != manifest.digest:
        raise DataLoss(f"{directory}: the bytes do not match {MANIFEST_FILE}'s digest (corrupt or altered)")


def checkpoint_proof(path: str) -> tuple[bytes, dict[str, bytes], ProbeBatch | None]:
    """What `weight_manifest.pb` records of a (verified) checkpoint directory: its identity, each
    tensor's digest (only when every tensor has one) and the trainer's probe; (b"", {}, None) without
    a manifest. DATA_LOSS for a probe that does not parse as one."""
    manifest_path = Path(path) / MANIFEST_FILE
    if not manifest_path.exists():
        return b"", {}, None
    manifest = common_pb2.WeightManifest.FromString(manifest_path.read_bytes())
    identity = bytes(manifest.identity)
    tensors = {t.name: bytes(t.digest) for t in manifest.tensors}
    try:
        tensors = checked_digests(identity, tensors if tensors and all(tensors.values()) else {}, str(manifest_path))
        probe = probe_from_pb(manifest.probe, f"{manifest_path}: probe")
    except InvalidArgument as exc:  # a file, not a request: what it holds is damaged
        raise DataLoss(str(exc)) from None
    return identity, tensors, probe


def verify_checkpoint(path: str, version: int, *, require_manifest: bool = False, verify_digest: bool = False) -> int:
    """Checks a checkpoint directory is complete; returns its weight bytes."""
    directory = Path(path)
    if not directory.is_dir():
        raise NotFound(f"checkpoint path {path!r} is not a directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise NotFound(f"checkpoint path {path!r} holds no *.safetensors file")
    headers = {f.name: read_header(f) for f in files}
    _check_index(directory, headers)
    tensors: dict[str, dict] = {}
    for file, header in headers.items():
        for name, entry in header.items():
            if name in tensors:
                raise DataLoss(f"{path}: tensor {name!r} appears in more than one file")
            tensors[name] = entry
    if (directory / MANIFEST_FILE).exists():
        _check_manifest(directory, version, tensors, verify_digest)
    elif require_manifest:
        raise FailedPrecondition(f"{path} has no {MANIFEST_FILE}, and this synchronizer requires one")
    return sum(int(e["data_offsets"][1]) - int(e["data_offsets"][0]) for e in tensors.values())
