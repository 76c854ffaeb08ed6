"""Weight-stream frames: serialized `PushWeightsRequest` / `PullWeightsResponse`
messages, built and read without copying chunk payloads through protobuf.

Both messages are `oneof payload { WeightManifest manifest = 1; WeightChunk
chunk = 2; }`, so a frame's bytes are the same in either direction: the
synchronizer keeps the frames a trainer pushed and writes those very bytes
to every reader (no re-serialization per pull), and a reader hands each
chunk's bytes to `WeightAssembler.add_serialized` (the codec's zero-copy
path, `flywheel.codec.wire`), so the payload is copied once on each side:
out of the tensor into the frame, and out of the frame into staging.
"""

from __future__ import annotations

from collections.abc import Iterator

from flywheel.codec import EncodedVersion
from flywheel.codec.wire import DATA_TAG
from flywheel.common.v1 import common_pb2
from flywheel.errors import DataLoss
from flywheel.varint import LEN, VarintError, encode_varint, field_key, read_varint

#: Field numbers of the `payload` oneof (the same in push requests and pull responses).
MANIFEST_FIELD = 1
CHUNK_FIELD = 2
SEGMENT_FIELD = 3  # shared memory: where the payloads are
SHARED_CHUNK_FIELD = 4  # shared memory: a chunk's header and its payload's place
_CHUNK_TAG = field_key(CHUNK_FIELD, LEN)
_MANIFEST_TAG = field_key(MANIFEST_FIELD, LEN)


def split_frame(frame: bytes | memoryview) -> tuple[int, memoryview]:
    """(MANIFEST_FIELD or CHUNK_FIELD, zero-copy view of the inner message)."""
    buf = memoryview(frame)
    if len(buf) == 0:
        raise DataLoss("weight frame is empty (neither a manifest nor a chunk)")
    try:
        key, pos = read_varint(buf, 0)
        field, wire = key >> 3, key & 7
        if field not in (MANIFEST_FIELD, CHUNK_FIELD) or wire != LEN:
            raise DataLoss(f"weight frame starts with field {field} (wire type {wire}), not a manifest or a chunk")
        n, pos = read_varint(buf, pos)
    except VarintError:
        raise DataLoss("weight frame: truncated or overlong varint") from None
    if pos + n != len(buf):
        raise DataLoss(f"weight frame: a {n}-byte message but {len(buf) - pos} bytes follow its header")
    return field, buf[pos:]


def frame_field(frame: bytes | memoryview) -> int:
    """The `payload` field a frame holds (0 for an empty or unreadable frame)."""
    try:
        key, _ = read_varint(memoryview(frame), 0)
    except VarintError:
        return 0
    return key >> 3


def manifest_frame(manifest: common_pb2.WeightManifest) -> bytes:
    body = manifest.SerializeToString()
    return b"".join((_MANIFEST_TAG, encode_varint(len(body)), body))


def chunk_frame(header: common_pb2.WeightChunk, payload: memoryview | bytes) -> bytes:
    """A chunk frame from a header (a WeightChunk without data) and its payload, copied once."""
    head = header.SerializeToString()
    if not len(payload):
        return b"".join((_CHUNK_TAG, encode_varint(len(head)), head))
    size = encode_varint(len(payload))
    inner = len(head) + len(DATA_TAG) + len(size) + len(payload)
    return b"".join((_CHUNK_TAG, encode_varint(inner), head, DATA_TAG, size, payload))


def wrap_chunk(serialized: bytes) -> bytes:
    """A chunk frame around an already serialized WeightChunk (one more copy)."""
    return b"".join((_CHUNK_TAG, encode_varint(len(serialized)), serialized))


def encoded_frames(encoded: EncodedVersion) -> Iterator[bytes]:
    """The frames of an encoded version: the manifest, then every chunk."""
    yield manifest_frame(encoded.manifest)
    # The codec's (header, payload view) pairs: each frame is built with a
    # single copy of its payload.
    for header, payload in encoded.pieces():
        yield chunk_frame(header, payload)

