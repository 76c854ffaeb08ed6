"""Delta versions: a record per tensor, applied bit-exact and verified against the target's identity."""

from __future__ import annotations

import pytest
import torch

from flywheel.codec.delta import (
    DeltaCorrupted,
    DeltaKind,
    apply_delta,
    apply_tensor_delta,
    encode_delta,
    encode_tensor_delta,
)
from flywheel.codec.errors import DigestMismatch, ManifestMismatch
from flywheel.codec.identity import identify


def _stepped(base: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """`base` after a small optimizer-like step that moves `fraction` of the elements."""
    g = torch.Generator().manual_seed(seed)
    moved = torch.rand(base.shape, generator=g) < fraction
    step = torch.randn(base.shape, generator=g, dtype=torch.float32) * 1e-2
    return torch.where(moved, (base.float() + step).to(base.dtype), base)


def _model(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(512, 64, generator=g).to(dtype),
        "layer.0.weight": torch.randn(64, 64, generator=g).to(dtype),
        "layer.0.bias": torch.zeros(64, dtype=dtype),
        "scalar": torch.tensor(1.5, dtype=dtype),
        "empty": torch.zeros(0, dtype=dtype),
    }


def test_a_bf16_step_travels_as_a_small_fraction_and_applies_bit_exact():
    base = _model(torch.bfloat16)
    new = {name: _stepped(t, 0.03, seed=i) if t.numel() > 1 else t.clone() for i, (name, t) in enumerate(base.items())}
    delta = encode_delta(base, new)
    assert delta.kinds["embed.weight"] in (DeltaKind.SPARSE, DeltaKind.XOR)
    assert delta.kinds["scalar"] is DeltaKind.SAME and delta.kinds["empty"] is DeltaKind.SAME
    assert delta.fraction < 0.15, delta.fraction
    result = apply_delta(base, delta.records, identify(new))
    for name in new:
        assert torch.equal(result[name].view(torch.int16) if result[name].numel() else result[name],
                           new[name].view(torch.int16) if new[name].numel() else new[name]), name


def test_a_float32_step_that_touches_every_element_still_saves_with_xor():
    base = _model(torch.float32)
    # A float32 step with a small learning rate moves every element by a few units in its last place.
    new = {name: t * (1 + 1e-6 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
           for name, t in base.items()}
    delta = encode_delta(base, new)
    assert delta.kinds["embed.weight"] is DeltaKind.XOR
    assert delta.fraction < 0.8, delta.fraction
    result = apply_delta(base, delta.records, identify(new))
    assert all(torch.equal(result[n].view(torch.int32), new[n].view(torch.int32)) for n in new if new[n].numel())


def test_each_kind_is_chosen_where_it_is_smallest():
    base = torch.randn(4096)
    assert encode_tensor_delta(base, base.clone()) == bytes([DeltaKind.SAME])
    # Replaced outright by random bit patterns: nothing to compress (a fresh Gaussian still shares
    # its exponent bytes with the old one, and XOR wins there).
    fresh = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(5)).view(torch.float32)
    record = encode_tensor_delta(base, fresh)
    assert record[0] == DeltaKind.RAW and len(record) == 1 + 4096 * 4
    few = base.clone()
    few[[3, 900, 4000]] = 7.0
    record = encode_tensor_delta(base, few)
    assert record[0] == DeltaKind.SPARSE and len(record) < 64
    for new in (fresh, few):
        assert torch.equal(apply_tensor_delta(base, encode_tensor_delta(base, new)).view(torch.int32),
                           new.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_every_kind_round_trips_in_every_width(dtype):
    g = torch.Generator().manual_seed(2)
    base = (torch.randn(1000, generator=g) * 50).to(dtype)
    for fraction in (0.001, 0.1, 0.6, 1.0):
        new = _stepped(base, fraction, seed=int(fraction * 1000)) if dtype.is_floating_point else \
            torch.where(torch.rand(1000, generator=g) < fraction, base + 1, base)
        assert torch.equal(apply_tensor_delta(base, encode_tensor_delta(base, new)), new)


def test_a_corrupt_record_is_refused_and_the_base_is_untouched():
    base = _model(torch.bfloat16)
    new = {name: _stepped(t, 0.05, seed=i) for i, (name, t) in enumerate(base.items())}
    delta = encode_delta(base, new)
    before = {n: t.clone() for n, t in base.items()}
    name = "embed.weight"
    record = bytearray(delta.records[name])
    record[len(record) // 2] ^= 0xFF
    with pytest.raises(DigestMismatch):  # a bad frame (DeltaCorrupted) or a wrong result: both DATA_LOSS
        apply_delta(base, {**delta.records, name: bytes(record)}, identify(new))
    with pytest.raises(DeltaCorrupted):
        apply_delta(base, {**delta.records, name: delta.records[name][:-5]}, identify(new))
    with pytest.raises(DeltaCorrupted, match="unknown kind"):
        apply_tensor_delta(base[name], bytes([9]) + delta.records[name][1:], name)
    assert all(torch.equal(base[n], before[n]) for n in base)


def test_a_delta_applied_to_the_wrong_base_is_refused_naming_the_tensor():
    base = _model(torch.bfloat16)
    new = {name: _stepped(t, 0.05, seed=i) for i, (name, t) in enumerate(base.items())}
    delta = encode_delta(base, new)
    other = dict(base, **{"layer.0.weight": _stepped(base["layer.0.weight"], 0.5, seed=99)})
    with pytest.raises(DigestMismatch, match="layer.0.weight"):
        apply_delta(other, delta.records, identify(new))


def test_a_delta_needs_the_same_tensors_on_both_sides():
    base = _model(torch.float32)
    with pytest.raises(ManifestMismatch):
        encode_delta(base, {**base, "extra": torch.zeros(2)})
    with pytest.raises(ManifestMismatch):
        encode_tensor_delta(base["scalar"], base["scalar"].to(torch.bfloat16))
    with pytest.raises(ManifestMismatch):
        apply_delta(base, {"scalar": bytes([DeltaKind.SAME])}, identify(base))


def test_decompression_is_bounded_by_the_tensors_size():
    import zstandard

    base = torch.zeros(16)
    bomb = bytes([DeltaKind.XOR]) + zstandard.ZstdCompressor().compress(bytes(1 << 20))  # 1 MiB for 64 bytes
    # Refused on the size the frame states, before decompressing (zstd would allocate that size).
    with pytest.raises(DeltaCorrupted, match="holds 1048576 bytes, expected 64"):
        apply_tensor_delta(base, bomb)
