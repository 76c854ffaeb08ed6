"""Shared helpers of the codec tests: random tensors of every dtype and layout."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from flywheel.codec import SUPPORTED_DTYPES

LAYOUTS = ("contiguous", "transposed", "strided", "offset", "expanded")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's row-major bytes, for bit-exact comparison (NaN payloads too)."""
    # A fresh tensor has standard strides even when empty (where .contiguous()
    # may keep odd ones that .view(uint8) rejects).
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    return fresh.reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Contiguous tensor of random bit patterns (any float bits: NaN, inf, subnormal)."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:  # only 0/1 bytes are valid bools
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def with_layout(dtype: torch.dtype, shape: tuple[int, ...], layout: str, seed: int) -> torch.Tensor:
    """A tensor of `shape` whose memory layout is `layout` (non-contiguous where possible)."""
    if layout == "transposed" and len(shape) >= 2:
        return random_tensor(dtype, tuple(reversed(shape)), seed).permute(*reversed(range(len(shape))))
    if layout == "strided" and len(shape) >= 1:
        base = random_tensor(dtype, (shape[0] * 2, *shape[1:]), seed)
        return base[::2]
    if layout == "offset" and len(shape) >= 1:
        base = random_tensor(dtype, (shape[0] + 1, *shape[1:]), seed)
        return base[1:]
    if layout == "expanded" and len(shape) >= 1:
        return random_tensor(dtype, (1, *shape[1:]), seed).expand(*shape)
    return random_tensor(dtype, shape, seed)


@st.composite
def tensors(draw: st.DrawFn, max_dims: int = 4, max_side: int = 6) -> torch.Tensor:
    dtype = draw(st.sampled_from(SUPPORTED_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, max_side), max_size=max_dims)))
    layout = draw(st.sampled_from(LAYOUTS))
    return with_layout(dtype, shape, layout, draw(st.integers(0, 2**31)))


@st.composite
def state_dicts(draw: st.DrawFn, max_tensors: int = 5) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.text(min_size=1, max_size=12), min_size=0, max_size=max_tensors, unique=True))
    # 3 dims keep tensors under ~2 KB, so 1-byte chunks stay fast to test.
    return {name: draw(tensors(max_dims=3)) for name in names}
