"""Versioned weight buffers: verification, commit/abort, eviction, cut-through readers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flywheel.codec import (
    ChunkCorrupted,
    ChunkDuplicated,
    DigestMismatch,
    InvalidManifest,
    StreamTruncated,
    WeightAssembler,
)
from flywheel.codec.wire import parse_chunk
from flywheel.common.v1 import common_pb2
from flywheel.errors import Aborted, AlreadyExists, NotFound, ResourceExhausted
from flywheel.transfer.frames import MANIFEST_FIELD, split_frame
from services.synchronizer.buffers import Phase, VersionBuffer, WeightStore
from tests.unit.synchronizer.sync_helpers import corrupt, frames_of, small_state


def assemble(frames: list[bytes]) -> dict[str, torch.Tensor]:
    field, inner = split_frame(frames[0])
    assert field == MANIFEST_FIELD
    asm = WeightAssembler(common_pb2.WeightManifest.FromString(bytes(inner)))
    for frame in frames[1:]:
        asm.add_serialized(split_frame(frame)[1])
    return asm.commit()


async def read_all(buffer: VersionBuffer) -> list[bytes]:
    return [f async for f in buffer.stream()]


async def test_commit_serves_the_exact_frames_to_every_reader() -> None:
    state = small_state()
    manifest, mframe, chunks = frames_of(state, 3)
    store = WeightStore(keep=2)
    buffer = store.begin(manifest, mframe)
    for frame, header, payload in chunks:
        buffer.add(frame, header, payload)
    store.commit(buffer)
    a, b = await asyncio.gather(read_all(buffer), read_all(buffer))
    assert a == b == [mframe, *(c[0] for c in chunks)]
    assert all(x is y for x, y in zip(a, b))  # shared, not copied per reader
    got = assemble(a)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert store.newest == 3 and buffer.held_bytes >= manifest.total_bytes


async def test_cut_through_reader_streams_chunks_as_they_land() -> None:
    manifest, mframe, chunks = frames_of(small_state(), 1)
    store = WeightStore(keep=1)
    buffer = store.begin(manifest, mframe)
    received: list[bytes] = []

    async def reader() -> None:
        async for frame in buffer.stream():
            received.append(frame)

    task = asyncio.ensure_future(reader())
    for i, (frame, header, payload) in enumerate(chunks):
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(received) == i + 1  # manifest + every chunk added so far, nothing more
        buffer.add(frame, header, payload)
    await asyncio.sleep(0.01)
    assert not task.done()  # all chunks read, but the stream ends only at commit
    store.commit(buffer)
    await asyncio.wait_for(task, 1)
    assert len(received) == len(chunks) + 1


async def test_abort_fails_readers_and_leaves_no_trace() -> None:
    store = WeightStore(keep=2)
    m1, f1, c1 = frames_of(small_state(1), 1)
    b1 = store.begin(m1, f1)
    for c in c1:
        b1.add(*c)
    store.commit(b1)
    m2, f2, c2 = frames_of(small_state(2), 2)
    b2 = store.begin(m2, f2)
    b2.add(*c2[0])
    task = asyncio.ensure_future(read_all(b2))
    await asyncio.sleep(0.01)
    store.abort(b2, Aborted("trainer went away"))
    with pytest.raises(Aborted, match="trainer went away"):
        await task
    assert store.find(2) is None and store.newest == 1 and b2.phase == Phase.ABORTED and b2.held_bytes == 0
    assert store.held_bytes == b1.held_bytes


def test_corrupt_duplicate_and_truncated_chunks_are_rejected() -> None:
    manifest, mframe, chunks = frames_of(small_state(), 1)
    buffer = VersionBuffer(manifest, mframe)
    bad = corrupt(chunks[0][0])
    with pytest.raises(ChunkCorrupted):
        buffer.add(bad, *parse_chunk(split_frame(bad)[1]))
    buffer.add(*chunks[0])
    with pytest.raises(ChunkDuplicated):
        buffer.add(*chunks[0])
    for c in chunks[1:-1]:
        buffer.add(*c)
    with pytest.raises(StreamTruncated):
        buffer.commit()


def test_tampered_manifest_fails_the_digest() -> None:
    manifest, mframe, chunks = frames_of(small_state(), 1)
    manifest.digest = bytes(16)
    buffer = VersionBuffer(manifest, mframe)
    for c in chunks:
        buffer.add(*c)
    with pytest.raises(DigestMismatch):
        buffer.commit()
    bad = common_pb2.WeightManifest()
    bad.CopyFrom(manifest)
    bad.chunk_count += 1
    with pytest.raises(InvalidManifest):
        VersionBuffer(bad, mframe)


async def test_eviction_keeps_newest_k_and_names_the_oldest() -> None:
    store = WeightStore(keep=2)
    for v in (1, 2, 3):
        m, f, cs = frames_of(small_state(v), v)
        b = store.begin(m, f)
        for c in cs:
            b.add(*c)
        assert store.commit(b) == ([1] if v == 3 else [])
    assert list(store.committed) == [2, 3]
    assert "oldest kept is 2" in str(store.evicted_error(1))


async def test_staging_limits_and_waiting_for_a_version() -> None:
    store = WeightStore(keep=1, max_staging=1)
    m, f, _ = frames_of(small_state(), 5)
    waiter = asyncio.ensure_future(store.wait_for(5, 1.0))
    await asyncio.sleep(0.01)
    b = store.begin(m, f)
    assert await waiter is b
    with pytest.raises(AlreadyExists):
        store.begin(m, f)
    m6, f6, _ = frames_of(small_state(), 6)
    with pytest.raises(ResourceExhausted):
        store.begin(m6, f6)
    assert await store.wait_for(9, 0.05) is None
    with pytest.raises(NotFound):
        raise store.evicted_error(1)
