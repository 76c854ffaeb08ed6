"""A version's identity: the same weights give the same identity however they
travel, different bytes give a different one, and receivers check it."""

from __future__ import annotations

import pytest
import torch

from flywheel.codec import (
    DigestMismatch,
    InvalidManifest,
    WeightAssembler,
    encode_state_dict,
    identify,
    manifest_identity,
)
from flywheel.codec.identity import IDENTITY_BLOCK_BYTES

MiB = 1 << 20


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(700, 1024, generator=g).to(torch.bfloat16),  # 1.4 MB: two blocks
        "layers.0.mlp.weight": torch.randn(64, 48, generator=g),
        "layers.0.norm.weight": torch.ones(48, dtype=torch.float16),
        "empty": torch.empty(0, 3),
        "step": torch.tensor(7, dtype=torch.int64),
    }


@pytest.mark.parametrize("chunk_bytes", [IDENTITY_BLOCK_BYTES, 64 * 1024, 4 * MiB - 65536, 333])
def test_the_identity_does_not_depend_on_the_chunk_size_but_the_transfer_digest_does(chunk_bytes: int) -> None:
    reference = encode_state_dict(state(), version=3, chunk_bytes=IDENTITY_BLOCK_BYTES).manifest
    other = encode_state_dict(state(), version=3, chunk_bytes=chunk_bytes).manifest
    assert other.identity == reference.identity and len(other.identity) == 16
    assert [t.digest for t in other.tensors] == [t.digest for t in reference.tensors]
    if chunk_bytes != IDENTITY_BLOCK_BYTES:
        assert other.digest != reference.digest  # the transfer's own digest binds its layout
    assert identify(state()).digest == reference.identity


def test_the_identity_does_not_depend_on_stream_order_nor_on_memory_layout() -> None:
    s = state()
    reordered = dict(reversed(list(s.items())))
    transposed = dict(s, **{"layers.0.mlp.weight": s["layers.0.mlp.weight"].t().contiguous().t()})
    assert not transposed["layers.0.mlp.weight"].is_contiguous()
    assert identify(reordered).digest == identify(s).digest == identify(transposed).digest
    assert encode_state_dict(reordered, version=1).manifest.identity == identify(s).digest


def test_one_changed_element_changes_the_identity_and_names_its_tensor() -> None:
    s = state()
    changed = {k: v.clone() for k, v in s.items()}
    changed["embed.weight"].view(-1)[123_456] += 1  # in the second 1 MiB block
    a, b = identify(s), identify(changed)
    assert a.digest != b.digest
    assert b.differences(a) == ["embed.weight"]
    assert "embed.weight" in b.describe_mismatch(a)
    # Name, dtype and shape are part of it too, not only the bytes.
    assert identify({"x": torch.zeros(4)}).digest != identify({"y": torch.zeros(4)}).digest
    assert identify({"x": torch.zeros(4)}).digest != identify({"x": torch.zeros(2, 2)}).digest
    assert identify({"x": torch.zeros(4)}).digest != identify({"x": torch.zeros(4, dtype=torch.int32)}).digest


def test_the_manifest_carries_each_tensors_digest() -> None:
    manifest = encode_state_dict(state(), version=2).manifest
    carried = manifest_identity(manifest)
    assert carried is not None and carried == identify(state())


def _assemble(manifest, encoded) -> None:
    asm = WeightAssembler(manifest)
    for chunk in encoded.chunks():
        asm.add(chunk)
    asm.commit()


def test_a_receiver_refuses_a_manifest_whose_tensor_digest_was_altered() -> None:
    encoded = encode_state_dict(state(), version=2, chunk_bytes=IDENTITY_BLOCK_BYTES)
    manifest = type(encoded.manifest)()
    manifest.CopyFrom(encoded.manifest)
    _assemble(manifest, encoded)  # intact: accepted
    manifest.tensors[0].digest = bytes(16)
    with pytest.raises(InvalidManifest, match="identity does not match"):
        _assemble(manifest, encoded)
    # Altered consistently (tensor digest and identity): the chunks themselves refute it.
    from flywheel.codec.identity import version_digest

    manifest.identity = version_digest({t.name: t.digest for t in manifest.tensors})
    with pytest.raises(DigestMismatch, match="embed.weight"):
        _assemble(manifest, encoded)


def test_a_malformed_identity_is_refused() -> None:
    encoded = encode_state_dict(state(), version=2)
    manifest = type(encoded.manifest)()
    manifest.CopyFrom(encoded.manifest)
    manifest.identity = b"short"
    with pytest.raises(InvalidManifest, match="identity is 5 bytes"):
        WeightAssembler(manifest)
