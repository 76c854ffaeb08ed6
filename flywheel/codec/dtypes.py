"""Element types and single-tensor conversion between torch and the wire.

`common_pb2.DType` <-> `torch.dtype`, element sizes, raw byte views of
tensors, and `tensor_to_proto` / `tensor_from_proto` for whole tensors (e.g.
training batches). Bytes are row-major little-endian: the host's layout, since
every platform torch ships for is little-endian (checked at import).
Everything moves as bytes (`.view(torch.uint8)`, memoryviews, `copy_`), never
element by element, so bf16, fp8 and NaN payloads survive bit for bit.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence

import torch

from flywheel.codec.errors import InvalidTensor, UnsupportedDType
from flywheel.common.v1 import common_pb2

if sys.byteorder != "little":  # pragma: no cover - no such torch platform today
    raise ImportError("flywheel.codec assumes a little-endian host (wire bytes are little-endian)")

_D = common_pb2.DType

_TORCH_TO_PROTO: dict[torch.dtype, int] = {
    torch.bool: _D.DTYPE_BOOL,
    torch.uint8: _D.DTYPE_UINT8,
    torch.uint16: _D.DTYPE_UINT16,
    torch.uint32: _D.DTYPE_UINT32,
    torch.uint64: _D.DTYPE_UINT64,
    torch.int8: _D.DTYPE_INT8,
    torch.int16: _D.DTYPE_INT16,
    torch.int32: _D.DTYPE_INT32,
    torch.int64: _D.DTYPE_INT64,
    torch.float16: _D.DTYPE_FLOAT16,
    torch.bfloat16: _D.DTYPE_BFLOAT16,
    torch.float32: _D.DTYPE_FLOAT32,
    torch.float64: _D.DTYPE_FLOAT64,
    torch.float8_e4m3fn: _D.DTYPE_FLOAT8_E4M3FN,
    torch.float8_e5m2: _D.DTYPE_FLOAT8_E5M2,
}
_PROTO_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in _TORCH_TO_PROTO.items()}
_ITEMSIZE: dict[int, int] = {v: k.itemsize for k, v in _TORCH_TO_PROTO.items()}

#: Every torch dtype the codec carries, in DType enum order.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_PROTO_TO_TORCH[v] for v in sorted(_PROTO_TO_TORCH))


def dtype_name(value: int) -> str:
    """`DTYPE_BFLOAT16`-style name of a wire dtype, or a description of a bad one."""
    try:
        return _D.Name(value)
    except ValueError:
        return f"unknown DType {value}"


def dtype_to_proto(dtype: torch.dtype) -> int:
    """Wire DType of a torch dtype; UnsupportedDType for complex, quantized, etc."""
    try:
        return _TORCH_TO_PROTO[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise UnsupportedDType(f"torch dtype {dtype} cannot travel on the wire; supported: {supported}") from None


def dtype_from_proto(value: int) -> torch.dtype:
    """Torch dtype of a wire DType; UnsupportedDType for UNSPECIFIED or unknown values."""
    try:
        return _PROTO_TO_TORCH[value]
    except KeyError:
        raise UnsupportedDType(f"{dtype_name(value)} ({value}) is not a tensor element type") from None


def element_size(value: int) -> int:
    """Bytes per element of a wire DType."""
    if value not in _ITEMSIZE:
        dtype_from_proto(value)  # raises with the standard message
    return _ITEMSIZE[value]


#: Most dimensions a wire tensor may have (torch's own limit is 64).
MAX_DIMS = 64


def expected_nbytes(dtype: int, shape: Sequence[int], what: str) -> int:
    """numel * itemsize for a wire dtype and shape; rejects negative dimensions.

    `what` names the tensor in error messages.
    """
    if any(d < 0 for d in shape):
        raise InvalidTensor(f"{what}: shape {list(shape)} has a negative dimension")
    if len(shape) > MAX_DIMS:
        raise InvalidTensor(f"{what}: shape has {len(shape)} dimensions, more than {MAX_DIMS}")
    itemsize = element_size(dtype)
    # torch lays a tensor out with int64 strides, which a zero dimension does not shrink: a shape such as
    # [0, 2**63 - 1] holds no bytes, yet cannot be made.
    if math.prod(max(d, 1) for d in shape) * itemsize >= 2**63:
        raise InvalidTensor(f"{what}: shape {list(shape)} is too large to lay out")
    return math.prod(shape) * itemsize


def contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when already a contiguous CPU tensor, else one row-major CPU copy.

    Detached so `.numpy()` works on parameters that require grad.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def byte_view(t: torch.Tensor) -> memoryview:
    """Zero-copy memoryview of a contiguous CPU tensor's bytes (any dtype, 0-d, empty)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor; call contiguous_cpu first")
    if t.numel() == 0:
        return memoryview(bytearray())  # writable, like the non-empty views
    # A contiguous tensor's elements sit at storage_offset + [0, numel) whatever
    # the strides of its size-1 dims, so view them flat with stride 1 (which
    # .view(uint8) needs; it also gives 0-d tensors a dimension). numpy knows
    # no bf16/fp8, but after the uint8 view it need not.
    flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())
    return memoryview(flat.view(torch.uint8).numpy())


def u8_from_buffer(buf: bytes | bytearray | memoryview) -> torch.Tensor:
    """uint8 tensor over `buf` without copying; any length, writable or not.

    torch.frombuffer rejects empty buffers, and warns about read-only ones
    (protobuf `bytes`); the tensor is only ever a copy_ source here, so the
    warning does not apply.
    """
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8)


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    """Whole tensor -> `Tensor` message (row-major bytes; one copy into the message)."""
    dtype = dtype_to_proto(t.dtype)
    src = contiguous_cpu(t)
    return common_pb2.Tensor(dtype=dtype, shape=list(src.shape), data=byte_view(src).tobytes())


def tensor_from_proto(msg: common_pb2.Tensor) -> torch.Tensor:
    """`Tensor` message -> new CPU tensor, bit-exact; InvalidTensor if the byte
    length does not equal numel * itemsize."""
    dtype = dtype_from_proto(msg.dtype)
    shape = list(msg.shape)
    data = msg.data  # one copy out of the message; read it once
    want = expected_nbytes(msg.dtype, shape, "tensor")
    if len(data) != want:
        raise InvalidTensor(
            f"tensor {dtype_name(msg.dtype)}{shape} needs {want} bytes "
            f"(numel {want // element_size(msg.dtype)} x {element_size(msg.dtype)}), got {len(data)}"
        )
    out = torch.empty(shape, dtype=dtype)
    if want:
        byte_view(out)[:] = data
    return out
