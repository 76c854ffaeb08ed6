"""Shared-memory segments and the synchronizer's storage on them: a reader
only ever uses the file the stream named, stale files of dead owners are
swept, segments are reused and never while someone reads them."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from flywheel.codec import WeightAssembler
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import split_frame
from flywheel.transfer.segments import HEADER_BYTES, PREFIX, OwnedSegment, SegmentMaps, SegmentUnavailable, sweep_stale
from services.synchronizer.buffers import COMMITTED_FRAME, WeightStore
from services.synchronizer.storage import SegmentPool, open_pool
from tests.unit.synchronizer.sync_helpers import frames_of, small_state


def test_a_reader_maps_the_named_segment_and_nothing_else(tmp_path: Path) -> None:
    owner = OwnedSegment(tmp_path, 10_000)
    owner.payload[:5] = b"hello"
    maps = SegmentMaps()
    view = maps.open(str(owner.path), owner.nonce, 10_000, HEADER_BYTES)
    assert bytes(view[:5]) == b"hello" and len(view) == 10_000
    owner.payload[:5] = b"HELLO"  # the same pages: the reader sees writes in place
    assert bytes(maps.open(str(owner.path), owner.nonce, 10_000, HEADER_BYTES)[:5]) == b"HELLO"
    with pytest.raises(SegmentUnavailable, match="not the segment the stream named"):
        maps.open(str(owner.path), bytes(16), 10_000, HEADER_BYTES)  # e.g. a same-named file on another host
    with pytest.raises(SegmentUnavailable, match="payload bytes"):
        maps.open(str(owner.path), owner.nonce, 20_000, HEADER_BYTES)
    with pytest.raises(SegmentUnavailable, match="header"):
        maps.open(str(owner.path), owner.nonce, 10_000, 512)
    path = str(owner.path)
    owner.close()
    assert not Path(path).exists()
    with pytest.raises(SegmentUnavailable, match="cannot map"):
        maps.open(path, owner.nonce, 10_000, HEADER_BYTES)


def test_a_replaced_file_is_mapped_afresh(tmp_path: Path) -> None:
    first = OwnedSegment(tmp_path, 4096)
    maps = SegmentMaps()
    maps.open(str(first.path), first.nonce, 4096, HEADER_BYTES)
    second = OwnedSegment(tmp_path, 4096)
    second.payload[:3] = b"new"
    os.replace(second.path, first.path)  # same path, another file (inode)
    view = maps.open(str(first.path), second.nonce, 4096, HEADER_BYTES)
    assert bytes(view[:3]) == b"new"


def test_maps_of_removed_segments_are_dropped(tmp_path: Path) -> None:
    maps = SegmentMaps()
    old, new = OwnedSegment(tmp_path, 4096), OwnedSegment(tmp_path, 4096)
    maps.open(str(old.path), old.nonce, 4096, HEADER_BYTES)
    old.close()  # e.g. the model changed size: the synchronizer made new segments
    maps.open(str(new.path), new.nonce, 4096, HEADER_BYTES)
    assert maps.paths == [str(new.path)]  # the removed file's memory is not pinned here


def _create_and_die(directory: str, conn) -> None:
    segment = OwnedSegment(Path(directory), 4096)
    conn.send(str(segment.path))
    os._exit(0)  # no cleanup: as if killed


def test_sweep_removes_only_segments_without_a_live_owner(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_create_and_die, args=(str(tmp_path), child))
    proc.start()
    orphan = Path(parent.recv())
    proc.join(30)
    alive = OwnedSegment(tmp_path, 4096)
    assert orphan.exists()
    assert sweep_stale(tmp_path) == [orphan]
    assert not orphan.exists() and alive.path.exists()
    alive.close()
    assert not list(tmp_path.glob(f"{PREFIX}*"))


def test_the_pool_reuses_segments_and_keeps_at_most_its_bound(tmp_path: Path) -> None:
    pool = SegmentPool(tmp_path, max_segments=2)
    a = pool.acquire(4096)
    pool.release(a)
    assert pool.acquire(4096) is a  # same size: the same file, already mapped
    b, c = pool.acquire(4096), pool.acquire(4096)  # a third held one (an evicted version still read)
    assert len({a, b, c}) == 3
    for s in (a, b, c):
        pool.release(s)
    assert len(list(tmp_path.glob(f"{PREFIX}*"))) == 2 and pool.free_bytes == 2 * 4096  # the bound
    d = pool.acquire(8192)  # another size: a free one makes room
    assert len(list(tmp_path.glob(f"{PREFIX}*"))) == 2 and d.size == 8192 and pool.free_bytes == 4096
    pool.close()
    assert not list(tmp_path.glob(f"{PREFIX}*"))


def test_no_usable_directory_means_no_pool(tmp_path: Path) -> None:
    assert open_pool("", 3) is None
    assert open_pool(str(tmp_path / "missing"), 3) is None
    assert open_pool(str(tmp_path), 3) is not None


def _place(frame: bytes) -> pb.SharedChunk:
    return pb.PullWeightsResponse.FromString(frame).shared_chunk


async def test_a_shared_reader_gets_headers_and_reads_payloads_in_place(tmp_path: Path) -> None:
    store = WeightStore(keep=1, pool=SegmentPool(tmp_path, 3))
    state = small_state(1)
    manifest, mframe, chunks = frames_of(state, 1)
    buffer = store.begin(manifest, mframe)
    for c in chunks:
        buffer.add(*c)
    store.commit(buffer)
    stream = buffer.stream(shared=True)
    assert await anext(stream) == mframe
    segment = pb.PullWeightsResponse.FromString(await anext(stream)).segment
    view = SegmentMaps().open(segment.path, segment.nonce, segment.size, segment.header_bytes)
    assembler = WeightAssembler(manifest)
    for (_, _, payload) in chunks:
        place = _place(await anext(stream))
        assert not place.chunk.data and place.length == len(payload)  # no payload in the stream
        assert bytes(view[place.segment_offset : place.segment_offset + place.length]) == bytes(payload)
        assembler.add_piece(place.chunk, view[place.segment_offset : place.segment_offset + place.length])
    assert await anext(stream) is COMMITTED_FRAME
    got = assembler.commit()
    assert all(torch.equal(got[k].view(-1).view(torch.uint8), state[k].view(-1).view(torch.uint8)) for k in state)
    await stream.aclose()
    # A reader that cannot map it gets the same version as ordinary frames, rebuilt from the segment.
    assert [f async for f in buffer.stream()] == [mframe, *(c[0] for c in chunks)]


async def test_a_segment_is_not_reused_while_an_evicted_version_is_read(tmp_path: Path) -> None:
    pool = SegmentPool(tmp_path, 3)
    store = WeightStore(keep=1, pool=pool)

    payloads = {}

    def push(version: int):
        manifest, mframe, chunks = frames_of(small_state(version), version)
        payloads[version] = b"".join(bytes(c[2]) for c in chunks)
        buffer = store.begin(manifest, mframe)
        for c in chunks:
            buffer.add(*c)
        store.commit(buffer)
        return buffer

    v1 = push(1)
    reader = v1.stream(shared=True, hold_seconds=30)
    frames = [await anext(reader) for _ in range(2 + v1.verifier.count)]
    assert await anext(reader) is COMMITTED_FRAME  # the reader now copies; the stream holds the segment
    segment = v1.storage.segment
    v2, v3 = push(2), push(3)  # version 1 is evicted, then version 2
    assert v1.readers == 1 and segment not in (v2.storage.segment, v3.storage.segment)
    assert bytes(segment.payload) == payloads[1]  # what the reader copies is still version 1
    assert split_frame(frames[0])[0] == 1
    await reader.aclose()  # the reader hangs up
    assert v1.readers == 0 and v1.held_bytes == 0
    v4 = push(4)
    assert v4.storage.segment in (segment, v2.storage.segment)  # freed segments are reused
    store.close()
    assert not list(tmp_path.glob(f"{PREFIX}*"))
