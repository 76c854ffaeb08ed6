"""Chunk layout and digest: the rules both ends must agree on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.codec import InvalidManifest, encode_state_dict
from flywheel.codec.layout import assign_buckets, compute_digest, plan_chunks, validate_manifest


@pytest.mark.parametrize(
    ("sizes", "bucket", "expected"),
    [
        ([10, 10, 10], 20, [0, 0, 1]),
        ([5, 100, 5, 5], 20, [0, 1, 2, 2]),  # a tensor over the bucket size is its own bucket
        ([100, 5], 20, [0, 1]),
        ([0, 0, 20, 0, 1], 20, [0, 0, 0, 0, 1]),
        ([], 20, []),
    ],
)
def test_bucket_assignment(sizes: list[int], bucket: int, expected: list[int]) -> None:
    assert assign_buckets(sizes, bucket) == expected


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), max_size=12),
    chunk=st.integers(1, 700),
    bucket=st.integers(1, 6000),
)
def test_plan_covers_every_tensor_exactly(sizes: list[int], chunk: int, bucket: int) -> None:
    plan = plan_chunks(sizes, chunk, bucket)
    assert plan.count == sum(max(1, -(-n // chunk)) for n in sizes)
    assert np.all(plan.length <= chunk)
    for i, n in enumerate(sizes):
        lo, hi = plan.tensor_bounds[i], plan.tensor_bounds[i + 1]
        assert np.all(plan.tensor_index[lo:hi] == i)
        offsets, lengths = plan.offset[lo:hi].astype(int), plan.length[lo:hi].astype(int)
        # contiguous, gap-free, in order, ending exactly at nbytes
        assert offsets[0] == 0 and np.all(offsets[1:] == (offsets + lengths)[:-1])
        assert int(offsets[-1] + lengths[-1]) == n
        assert len(set(plan.bucket_index[lo:hi].tolist())) == 1
    buckets = assign_buckets(sizes, bucket)
    assert buckets == sorted(buckets)
    for b in set(buckets):
        members = [n for n, x in zip(sizes, buckets) if x == b]
        assert sum(members) <= bucket or len(members) == 1 or sum(members[:-1]) == 0
    assert int(plan.bucket_chunk_counts.sum()) == plan.count


def test_digest_binds_header_names_and_checksums() -> None:
    enc = encode_state_dict({"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int8)}, 4, chunk_bytes=16)
    entries, plan = validate_manifest(enc.manifest)
    base = compute_digest(enc.manifest, entries, plan, enc.checksums)
    assert base == enc.manifest.digest and len(base) == 16

    checksums = enc.checksums.copy()
    checksums[1] ^= np.uint64(1)
    assert compute_digest(enc.manifest, entries, plan, checksums) != base

    other = type(enc.manifest)()
    other.CopyFrom(enc.manifest)
    other.version = 5
    assert compute_digest(other, entries, plan, enc.checksums) != base

    renamed = encode_state_dict({"a": torch.arange(10.0), "c": torch.ones(3, dtype=torch.int8)}, 4, chunk_bytes=16)
    assert renamed.manifest.digest != base


def test_plan_rejects_non_positive_sizes() -> None:
    with pytest.raises(InvalidManifest):
        plan_chunks([1], 0, 10)
    with pytest.raises(InvalidManifest):
        plan_chunks([1], 10, 0)


def test_parallel_hashing_survives_fork() -> None:
    """A forked child (vLLM, multiprocessing) inherits the hash pool without
    its threads; hashing there must not hang."""
    import multiprocessing as mp

    n = 20 << 20  # big enough for the thread pool
    expected = _digest_of_ones(n)  # creates the pool in this process
    with mp.get_context("fork").Pool(1) as pool:
        assert pool.apply_async(_digest_of_ones, (n,)).get(timeout=60) == expected


def _digest_of_ones(n: int) -> bytes:
    # numpy, not torch.ones: torch's OpenMP pool is not usable in a forked child
    ones = torch.from_numpy(np.ones(n, dtype=np.uint8))
    return encode_state_dict({"w": ones}, 1).manifest.digest
