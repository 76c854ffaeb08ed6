"""A directory of safetensors files, as checkpoints and model directories
hold weights: its files, each tensor's dtype and shape read from the headers
without loading a byte of data, and every tensor read.

Errors carry gRPC codes: NOT_FOUND for a missing directory or one without
files, DATA_LOSS for a truncated or unreadable file, INVALID_ARGUMENT for a
name twice or a dtype torch has no type for.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from flywheel.errors import DataLoss, InvalidArgument, NotFound

#: safetensors' dtype names -> torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: A header larger than this is not a safetensors file's (they hold names, dtypes, shapes, offsets).
_MAX_HEADER_BYTES = 100 * 2**20


def safetensors_files(path: Path) -> list[Path]:
    """The directory's *.safetensors files, in name order."""
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
            if length > _MAX_HEADER_BYTES:
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


def header_specs(files: list[Path]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor's (dtype, shape) across `files`, from their headers."""
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for file in files:
        for name, meta in _header(file).items():
            if name in specs:
                raise InvalidArgument(f"tensor {name!r} appears in more than one file of the checkpoint")
            dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"))
            if dtype is None:
                raise InvalidArgument(f"{file.name}: tensor {name!r} has unsupported dtype {meta.get('dtype')!r}")
            specs[name] = (dtype, tuple(meta["shape"]))
    return specs


def read_tensors(files: list[str] | list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of `files` (DATA_LOSS naming the file that cannot be read)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise DataLoss(f"{Path(file).name}: cannot read: {exc}") from None
    return tensors
