"""MEMORY weight plane and failure handling over real gRPC: broken pushes leave
no trace, evictions, shared cut-through reads, lease expiry mid-sync, metrics."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
import torch

from flywheel.codec import ChunkCorrupted, encode_state_dict
from flywheel.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from flywheel.runtime.client import client_streaming_call, open_channel
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import encoded_frames
from flywheel.transfer.segments import HEADER_BYTES, PushSegments
from flywheel.synchronizer import pull
from flywheel.synchronizer.client import SynchronizerClient
from services.synchronizer.embedded import embedded_synchronizer
from flywheel.synchronizer.types import Role, State, TransferState
from tests.unit.synchronizer.sync_helpers import corrupt, small_state


#: The details of every failed raw_push, by status code (what an unexpected code said).
PUSH_DETAILS: dict[grpc.StatusCode, str] = {}


async def raw_push(address: str, frames: list[bytes]) -> grpc.StatusCode:
    async with open_channel(address, max_attempts=1) as channel:
        push = channel.stream_unary(
            "/flywheel.synchronizer.v1.SynchronizerService/PushWeights",
            request_serializer=None, response_deserializer=pb.PushWeightsResponse.FromString,
        )
        try:
            await client_streaming_call(push, lambda: iter(frames), timeout=10)
        except grpc.aio.AioRpcError as exc:
            PUSH_DETAILS[exc.code()] = exc.details() or ""
            return exc.code()
    return grpc.StatusCode.OK


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)) for k in a)


async def test_broken_pushes_leave_no_trace_and_the_old_version_is_served() -> None:
    v1, v2 = small_state(1, scale=40), small_state(2, scale=40)
    async with embedded_synchronizer(keep_versions=2) as server, SynchronizerClient(server.address) as c:
        await c.push_weights(v1, 1, chunk_bytes=4096)
        frames = list(encoded_frames(encode_state_dict(v2, 2, chunk_bytes=4096)))
        assert len(frames) > 4
        # A reader waiting for version 2 starts streaming it while it arrives ...
        reader = asyncio.ensure_future(c.pull_weights(2, wait_seconds=10))
        await asyncio.sleep(0.1)
        broken = [*frames[:3], corrupt(frames[3]), *frames[4:]]
        assert await raw_push(server.address, broken) == grpc.StatusCode.DATA_LOSS
        with pytest.raises(Aborted, match="push of version 2 was aborted"):
            await reader  # ... and is told the version will never be whole
        assert await raw_push(server.address, frames[:-1]) == grpc.StatusCode.DATA_LOSS  # truncated
        assert await raw_push(server.address, frames[1:]) == grpc.StatusCode.INVALID_ARGUMENT  # no manifest
        status = await c.status()
        assert status.latest_version == 1 and [v.version for v in status.versions] == [1]
        pulled = await c.pull_weights()
        assert pulled.version == 1 and same(pulled.tensors, v1)
        # The same version pushed whole afterwards is accepted.
        assert (await c.push_weights(v2, 2, chunk_bytes=4096)).kept_versions == [1, 2]
        with pytest.raises(FailedPrecondition, match="not newer than the newest committed version 2"):
            await c.push_weights(v1, 2)
        assert same((await c.pull_weights(2)).tensors, v2)


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize("shared", [False, True], ids=["heap", "shared-memory"])
async def test_keep_k_versions_eviction_and_shared_cut_through_pulls(shared: bool, tmp_path) -> None:
    state = small_state(0, scale=200)
    shm = str(tmp_path) if shared else ""
    async with embedded_synchronizer(keep_versions=2, shared_memory_dir=shm) as server, \
            SynchronizerClient(server.address) as c:
        for v in (1, 2, 3):
            await c.push_weights(state, v)
        with pytest.raises(NotFound, match="oldest kept is 2") as info:
            await c.pull_weights(1)
        assert info.value.code == "NOT_FOUND"
        held = (await c.status()).held_bytes
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        # Two versions, one copy each; with shared memory, version 1's segment
        # is also kept, free, for the next push to reuse.
        copies = 3 if shared else 2
        assert copies * nbytes <= held < copies * nbytes + 64 * 1024
        assert len(list(tmp_path.glob("flywheel-weights-*"))) == (3 if shared else 0)
        in_place = metric(server.metrics_url, "flywheel_weight_pull_shared_bytes_total")
        # Three readers of version 4 before it exists, one push: they share its one copy.
        destinations = [{k: torch.zeros_like(t) for k, t in state.items()} for _ in range(3)]
        readers = [asyncio.ensure_future(c.pull_weights(4, into=d, wait_seconds=10)) for d in destinations]
        await asyncio.sleep(0.1)
        await c.push_weights(state, 4)
        for r, d in zip(await asyncio.gather(*readers), destinations):
            assert r.version == 4 and r.tensors is not None and same(d, state)
        assert (await c.status()).held_bytes == held  # still two versions (version 2's segment reused)
        read_in_place = metric(server.metrics_url, "flywheel_weight_pull_shared_bytes_total") - in_place
        assert read_in_place == (3 * nbytes if shared else 0)
    assert not list(tmp_path.glob("flywheel-weights-*"))  # removed at shutdown


async def test_a_reader_that_cannot_map_the_segment_pulls_over_the_stream(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pull, "_UNMAPPABLE", set())
    state = small_state(3, scale=50)
    async with embedded_synchronizer(shared_memory_dir=str(tmp_path)) as server, \
            SynchronizerClient(server.address) as c:
        await c.push_weights(state, 1)
        for path in tmp_path.glob("flywheel-weights-*"):
            path.unlink()  # what a reader on another host sees: no such file
        pulled = await c.pull_weights(1)
        assert pulled.version == 1 and same(pulled.tensors, state)
        assert server.address in pull._UNMAPPABLE  # not offered again
        in_place = metric(server.metrics_url, "flywheel_weight_pull_shared_bytes_total")
        assert same((await c.pull_weights(1)).tensors, state)
        assert metric(server.metrics_url, "flywheel_weight_pull_shared_bytes_total") == in_place


async def test_bytes_changed_in_shared_memory_are_caught_before_the_destination(tmp_path) -> None:
    state = small_state(4, scale=50)
    async with embedded_synchronizer(shared_memory_dir=str(tmp_path)) as server, \
            SynchronizerClient(server.address) as c:
        await c.push_weights(state, 1)
        [segment] = tmp_path.glob("flywheel-weights-*")
        with open(segment, "r+b") as f:  # a stray writer, after the synchronizer verified the chunks
            f.seek(HEADER_BYTES + 100)
            f.write(b"\xff" * 8)
        dest = {k: torch.zeros_like(t) for k, t in state.items()}
        with pytest.raises(ChunkCorrupted) as info:
            await c.pull_weights(1, into=dest)
        assert info.value.code == "DATA_LOSS"
        assert all(not t.any() for t in dest.values())  # untouched


async def test_rollout_lease_expiring_mid_sync_does_not_block_the_trainer() -> None:
    async with embedded_synchronizer(lease_seconds=1.0, sweep_interval_seconds=0.05) as server:
        async with SynchronizerClient(server.address) as t, SynchronizerClient(server.address) as a, \
                SynchronizerClient(server.address) as b:
            await t.configure_policy("fixed", "nccl", 1)
            await t.register(Role.TRAINER, "trainer")
            await a.register(Role.ROLLOUT, "a", capabilities=["nccl"])
            await b.register(Role.ROLLOUT, "b", capabilities=["nccl"])
            async with t.keep_alive("trainer"), a.keep_alive("a"):
                beats_b = b.keep_alive("b").start()
                group = await t.allocate_group(1, "trainer", timeout_seconds=60)
                assert set(group.ranks) == {"trainer", "a", "b"}
                await a.set_state("a", State.REQUIRE_SYNC)
                await a.set_state("a", State.WAITING_SYNC)
                await a.report_transfer(group.group_id, "a", True)
                await beats_b.stop()  # b dies in the middle of the sync
                started = time.monotonic()
                await t.report_transfer(group.group_id, "trainer", True)
                outcome = await t.get_transfer(group.group_id, wait_seconds=60)
                waited = time.monotonic() - started
                assert outcome.state == TransferState.ABORTED and "b left: lease expired" in outcome.error
                assert waited < 5, f"the trainer waited {waited:.1f}s on a dead rollout (deadline 60s)"
                status = await t.status()
                assert {c.id: c.state for c in status.components} == {
                    "trainer": State.RUNNING, "a": State.RUNNING, "b": State.STOPPED,
                }
                # The group is rebuilt without b, and the sync goes through.
                again = await t.allocate_group(1, "trainer")
                assert set(again.ranks) == {"trainer", "a"}
                await a.report_transfer(again.group_id, "a", True)
                # The sender's confirmation (with what it sent) completes it.
                await t.report_transfer(again.group_id, "trainer", True, identity=b"\x05" * 16)
                assert (await t.get_transfer(again.group_id)).state == TransferState.COMMITTED
                assert (await t.status()).component("a").weight_version == 1


async def test_metrics_report_states_versions_and_bytes() -> None:
    state = small_state(0, scale=10)
    async with embedded_synchronizer() as server, SynchronizerClient(server.address) as c:
        await c.register("rollout", "r-metrics")
        await c.push_weights(state, 7)
        await c.pull_weights(7)
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(server.metrics_url, timeout=5).read().decode())
    assert 'flywheel_synchronizer_components{role="rollout",state="running"}' in text
    assert "flywheel_synchronizer_latest_version 7.0" in text
    assert "flywheel_synchronizer_weight_versions_held 1.0" in text
    for family in ("flywheel_weight_push_bytes_total", "flywheel_weight_pull_bytes_total",
                   "flywheel_synchronizer_weights_held_bytes", 'flywheel_weight_sync_duration_seconds_count{method="memory"}'):
        line = next(x for x in text.splitlines() if x.startswith(family))
        assert float(line.split()[-1]) > 0, line


async def test_a_stalled_push_times_out_and_its_readers_are_told() -> None:
    encoded = encode_state_dict(small_state(), 1, chunk_bytes=512)
    frames = list(encoded_frames(encoded))

    async def stall():
        yield frames[0]
        yield frames[1]
        await asyncio.sleep(30)  # the trainer hangs

    async with embedded_synchronizer(push_idle_timeout_seconds=0.3) as server, SynchronizerClient(server.address) as c:
        reader = asyncio.ensure_future(c.pull_weights(1, wait_seconds=10))
        await asyncio.sleep(0.1)
        async with open_channel(server.address, max_attempts=1) as channel:
            push = channel.stream_unary(
                "/flywheel.synchronizer.v1.SynchronizerService/PushWeights",
                request_serializer=None, response_deserializer=pb.PushWeightsResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await push(stall(), timeout=10)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "sent nothing for 0.3s" in info.value.details()
        with pytest.raises(Aborted):
            await reader
        status = await c.status()
        # No trace of the version; in shared memory its segment stays, free, for the next push.
        assert status.versions == [] and status.held_bytes in (0, encoded.manifest.total_bytes)


async def test_checkpoint_versions_are_checked_then_announced(tmp_path) -> None:
    from safetensors.torch import save_file

    state = {k: v for k, v in small_state().items() if v.numel()}
    root = tmp_path / "published"
    good, bad, elsewhere = root / "v5", root / "v6", tmp_path / "elsewhere"
    for d in (good, bad, elsewhere):
        d.mkdir(parents=True)
        save_file(state, str(d / "model.safetensors"))
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:-7])  # a torn copy
    async with embedded_synchronizer() as server, SynchronizerClient(server.address) as c:
        with pytest.raises(FailedPrecondition, match="accepts no paths"):
            await c.register_checkpoint(5, str(good), "trainer")  # no checkpoint_root: no CHECKPOINT versions
    async with embedded_synchronizer(checkpoint_root=root) as server, SynchronizerClient(server.address) as c:
        events = c.watch(send_initial=False)
        first = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.1)
        # Paths outside the root, or that no file system holds, are refused before anything is read.
        for path, error in [(str(elsewhere), PermissionDenied), ("v5/../../elsewhere", PermissionDenied),
                            ("v5\0", InvalidArgument), ("x" * 300, InvalidArgument)]:
            with pytest.raises(error):
                await c.register_checkpoint(5, path, "trainer")
        assert not first.done()
        assert await c.register_checkpoint(5, str(good), "trainer") == 5
        event = await asyncio.wait_for(first, 5)
        assert (event.kind.name, event.version, event.location, event.method.name) == (
            "VERSION_COMMITTED", 5, str(good), "CHECKPOINT",
        )
        assert await c.get_checkpoint() == (5, str(good))
        with pytest.raises(Exception) as info:
            await c.register_checkpoint(6, str(bad), "trainer")
        assert info.value.code == "DATA_LOSS" and "truncated" in str(info.value)
        with pytest.raises(FailedPrecondition, match="not newer"):
            await c.register_checkpoint(4, str(good), "trainer")
        assert await c.register_checkpoint(5, str(good), "trainer") == 5  # a retry is fine
        with pytest.raises(FailedPrecondition, match="CHECKPOINT"):
            await c.pull_weights()  # the newest version travels by path, not bytes
        await events.aclose()


async def test_a_push_of_compressed_chunks_is_refused() -> None:
    from flywheel.transfer.compression import compressed_frame

    frames = list(encoded_frames(encode_state_dict(small_state(1, scale=40), 1, chunk_bytes=4096)))
    async with embedded_synchronizer() as server:
        pushed = [frames[0], *(compressed_frame(f) for f in frames[1:])]
        assert await raw_push(server.address, pushed) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def push_segments(tmp_path, monkeypatch):
    """This process's push segments in tmp_path/pusher, and no synchronizer remembered as unmappable."""
    from flywheel.synchronizer import push

    directory = tmp_path / "pusher"
    directory.mkdir()
    segments = PushSegments(directory)
    monkeypatch.setattr(push, "PUSH_SEGMENTS", segments)
    monkeypatch.setattr(push, "_UNMAPPABLE", set())
    yield segments
    segments.close()


async def test_a_push_on_the_synchronizers_host_hands_its_payloads_over_in_shared_memory(push_segments) -> None:
    v1, v2 = small_state(5, scale=60), small_state(6, scale=60)
    nbytes = sum(t.numel() * t.element_size() for t in v1.values())
    async with embedded_synchronizer(shared_memory_dir=str(push_segments.directory)) as server, \
            SynchronizerClient(server.address) as c:
        before = metric(server.metrics_url, "flywheel_weight_push_shared_bytes_total")
        reader = asyncio.ensure_future(c.pull_weights(1, wait_seconds=10, at_least=True))  # cut-through
        await asyncio.sleep(0.05)
        await c.push_weights(v1, 1, chunk_bytes=4096)
        segment = push_segments.get(nbytes)
        await c.push_weights(v2, 2, chunk_bytes=4096)  # the same segment, rewritten
        assert push_segments.get(nbytes) is segment
        assert metric(server.metrics_url, "flywheel_weight_push_shared_bytes_total") - before == 2 * nbytes
        assert same((await reader).tensors, v1)
        assert same((await c.pull_weights(1)).tensors, v1) and same((await c.pull_weights(2)).tensors, v2)


async def test_a_shared_memory_push_is_verified_after_the_copy_and_foreign_files_are_refused(push_segments) -> None:
    from flywheel.transfer.frames import manifest_frame

    state = small_state(7, scale=60)
    encoded = encode_state_dict(state, 1, chunk_bytes=4096)
    segment = push_segments.get(encoded.manifest.total_bytes)

    def frames(path: str, nonce: bytes, corrupt_at: int | None = None) -> list[bytes]:
        out = [manifest_frame(encoded.manifest), pb.PushWeightsRequest(segment=pb.SharedSegment(
            path=path, nonce=nonce, size=segment.size, header_bytes=HEADER_BYTES)).SerializeToString()]
        offset = 0
        for header, payload in encoded.pieces():
            segment.payload[offset : offset + len(payload)] = payload
            if corrupt_at is not None and offset <= corrupt_at < offset + len(payload):
                segment.payload[corrupt_at] ^= 0xFF  # the pusher's bytes differ from its checksum
            out.append(pb.PushWeightsRequest(shared_chunk=pb.SharedChunk(
                chunk=header, segment_offset=offset, length=len(payload))).SerializeToString())
            offset += len(payload)
        return out

    async with embedded_synchronizer(shared_memory_dir=str(push_segments.directory)) as server, \
            SynchronizerClient(server.address) as c:
        path = str(segment.path)
        assert await raw_push(server.address, frames(path, segment.nonce, corrupt_at=5000)) == grpc.StatusCode.DATA_LOSS
        assert await raw_push(server.address, frames(path, b"x" * 16)) == grpc.StatusCode.FAILED_PRECONDITION
        assert await raw_push(server.address, frames("/etc/passwd", segment.nonce)) == grpc.StatusCode.FAILED_PRECONDITION
        assert (await c.status()).latest_version == 0  # nothing committed
        assert await raw_push(server.address, frames(path, segment.nonce)) == grpc.StatusCode.OK
        assert same((await c.pull_weights(1)).tensors, state)


async def test_every_early_refusal_of_a_push_reaches_the_pusher_with_the_servers_status(push_segments) -> None:
    """The synchronizer refuses a segment at the push's second frame, while the
    pusher is still writing: grpc's asyncio client then reported INTERNAL in
    about 2 % of pushes (grpc/grpc#36066), and a pusher that cannot tell a
    refused segment from a failure does not fall back to the stream."""
    from flywheel.transfer.frames import manifest_frame

    encoded = encode_state_dict(small_state(9, scale=60), 1, chunk_bytes=4096)
    segment = push_segments.get(encoded.manifest.total_bytes)
    frames = [manifest_frame(encoded.manifest), pb.PushWeightsRequest(segment=pb.SharedSegment(
        path=str(segment.path), nonce=b"x" * 16, size=segment.size, header_bytes=HEADER_BYTES)).SerializeToString()]
    offset = 0
    for header, payload in encoded.pieces():
        frames.append(pb.PushWeightsRequest(shared_chunk=pb.SharedChunk(
            chunk=header, segment_offset=offset, length=len(payload))).SerializeToString())
        offset += len(payload)
    assert len(frames) > 50  # still writing when the refusal comes
    async with embedded_synchronizer(shared_memory_dir=str(push_segments.directory)) as server:
        codes = [await raw_push(server.address, frames) for _ in range(300)]
    assert set(codes) == {grpc.StatusCode.FAILED_PRECONDITION}, {c: (codes.count(c), PUSH_DETAILS.get(c)) for c in set(codes)}


async def test_a_synchronizer_that_cannot_map_the_pushers_segment_gets_the_payloads_in_the_stream(
    push_segments, tmp_path
) -> None:
    from flywheel.synchronizer import push

    elsewhere = tmp_path / "synchronizer-shm"  # what a synchronizer on another host sees: not this directory
    elsewhere.mkdir()
    state = small_state(8, scale=60)
    async with embedded_synchronizer(shared_memory_dir=str(elsewhere)) as server, \
            SynchronizerClient(server.address) as c:
        before = metric(server.metrics_url, "flywheel_weight_push_shared_bytes_total")  # the process's servers add up
        await c.push_weights(state, 1)
        assert server.address in push._UNMAPPABLE  # not offered again
        await c.push_weights(state, 2)
        assert metric(server.metrics_url, "flywheel_weight_push_shared_bytes_total") == before
        assert same((await c.pull_weights(2)).tensors, state)
        assert (await c.status()).latest_version == 2
