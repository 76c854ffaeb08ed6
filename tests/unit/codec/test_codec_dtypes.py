"""dtype mapping and single-tensor Tensor messages: bit-exact, any layout."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from flywheel.codec import (
    SUPPORTED_DTYPES,
    InvalidTensor,
    UnsupportedDType,
    dtype_from_proto,
    dtype_to_proto,
    element_size,
    tensor_from_proto,
    tensor_to_proto,
)
from flywheel.common.v1 import common_pb2
from flywheel.errors import InvalidArgument
from tests.unit.codec.codec_helpers import bits, same_bits, tensors, with_layout


def test_every_wire_dtype_maps_to_a_torch_dtype_and_back() -> None:
    values = [v for v in common_pb2.DType.values() if v != common_pb2.DTYPE_UNSPECIFIED]
    assert len(values) == 15 == len(SUPPORTED_DTYPES)
    for v in values:
        dtype = dtype_from_proto(v)
        assert dtype_to_proto(dtype) == v
        assert element_size(v) == torch.empty(0, dtype=dtype).element_size()
    assert dtype_from_proto(common_pb2.DTYPE_BFLOAT16) is torch.bfloat16
    assert dtype_from_proto(common_pb2.DTYPE_FLOAT8_E4M3FN) is torch.float8_e4m3fn
    assert element_size(common_pb2.DTYPE_UINT64) == 8


@pytest.mark.parametrize("dtype", [torch.complex64, torch.quint8, torch.float8_e4m3fnuz])
def test_unsupported_torch_dtype_is_named(dtype: torch.dtype) -> None:
    with pytest.raises(UnsupportedDType, match=str(dtype)) as info:
        dtype_to_proto(dtype)
    assert info.value.code == "INVALID_ARGUMENT"
    assert isinstance(info.value, InvalidArgument)


@pytest.mark.parametrize("value", [common_pb2.DTYPE_UNSPECIFIED, 99])
def test_unsupported_wire_dtype(value: int) -> None:
    with pytest.raises(UnsupportedDType, match=str(value)):
        dtype_from_proto(value)
    with pytest.raises(UnsupportedDType):
        tensor_from_proto(common_pb2.Tensor(dtype=value, shape=[1], data=b"\0"))


@settings(max_examples=150, deadline=None)
@given(t=tensors())
def test_tensor_round_trip_is_bit_exact(t: torch.Tensor) -> None:
    msg = tensor_to_proto(t)
    assert len(msg.data) == t.numel() * t.element_size()
    # Through the wire bytes too, as a real transport would.
    back = tensor_from_proto(common_pb2.Tensor.FromString(msg.SerializeToString()))
    assert same_bits(back, t)
    assert back.is_contiguous()


@pytest.mark.parametrize(
    ("dtype", "patterns"),
    [
        (torch.float32, [0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x80000000]),  # NaN payloads, sNaN, -0.0
        (torch.int32, [-1, 0, 2**31 - 1]),
    ],
)
def test_nan_payloads_and_signed_zero_survive(dtype: torch.dtype, patterns: list[int]) -> None:
    t = torch.from_numpy(np.array(patterns, dtype=np.int64).astype(np.uint32)).view(dtype)
    assert same_bits(tensor_from_proto(tensor_to_proto(t)), t)


def test_low_precision_nan_bits_survive() -> None:
    bf16 = torch.from_numpy(np.array([0x7FC1, 0xFF81, 0x0001], dtype=np.uint16)).view(torch.bfloat16)
    fp8 = torch.tensor([0x7F, 0xFF, 0x01], dtype=torch.uint8).view(torch.float8_e4m3fn)
    for t in (bf16, fp8, bf16.reshape(3, 1).t()):
        assert same_bits(tensor_from_proto(tensor_to_proto(t)), t)


def test_zero_dim_and_empty_tensors() -> None:
    scalar = torch.tensor(3.5, dtype=torch.bfloat16)
    msg = tensor_to_proto(scalar)
    assert list(msg.shape) == [] and len(msg.data) == 2
    assert same_bits(tensor_from_proto(msg), scalar)
    empty = torch.empty(0, 4, dtype=torch.float8_e5m2)
    msg = tensor_to_proto(empty)
    assert list(msg.shape) == [0, 4] and msg.data == b""
    out = tensor_from_proto(msg)
    assert out.shape == (0, 4) and out.dtype == torch.float8_e5m2


def test_non_contiguous_views_send_logical_row_major_order() -> None:
    base = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    msg = tensor_to_proto(base.t())
    assert msg.data == base.t().contiguous().numpy().tobytes()
    assert list(msg.shape) == [3, 2]
    expanded = with_layout(torch.float16, (4, 3), "expanded", seed=1)
    assert same_bits(tensor_from_proto(tensor_to_proto(expanded)), expanded)


def test_requires_grad_parameter_is_accepted() -> None:
    p = torch.nn.Parameter(torch.randn(3, 2))
    assert same_bits(tensor_from_proto(tensor_to_proto(p)), p.detach())


@pytest.mark.parametrize(("shape", "nbytes"), [([2, 3], 11), ([2, 3], 13), ([], 0), ([0], 1)])
def test_wrong_byte_length_is_named(shape: list[int], nbytes: int) -> None:
    msg = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT16, shape=shape, data=b"\1" * nbytes)
    want = 2 * (shape[0] * shape[1] if len(shape) == 2 else (1 if not shape else 0))
    with pytest.raises(InvalidTensor, match=f"needs {want} bytes .* got {nbytes}") as info:
        tensor_from_proto(msg)
    assert info.value.code == "INVALID_ARGUMENT"


def test_negative_dimension_rejected() -> None:
    with pytest.raises(InvalidTensor, match="negative"):
        tensor_from_proto(common_pb2.Tensor(dtype=common_pb2.DTYPE_UINT8, shape=[-1], data=b""))


def test_decoding_readonly_bytes_emits_no_warning() -> None:
    msg = tensor_to_proto(torch.ones(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tensor_from_proto(msg)
    assert torch.equal(out, torch.ones(4))
    out += 1  # the result owns writable memory, independent of the message
    assert bits(tensor_from_proto(msg)).sum() == bits(torch.ones(4)).sum()


@pytest.mark.parametrize("shape", [[0, 2, 2**63 - 1], [2**40, 2**40], [1] * 65])
def test_shapes_torch_cannot_lay_out_are_invalid_even_when_empty(shape: list[int]) -> None:
    # A zero dimension makes the byte count 0, and the data (none) matches it; the layout still cannot be made.
    msg = common_pb2.Tensor(dtype=common_pb2.DTYPE_BOOL, shape=shape, data=b"")
    with pytest.raises(InvalidTensor, match="too large|dimensions"):
        tensor_from_proto(msg)
