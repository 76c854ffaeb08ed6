"""The catalog of committed weight versions, whatever method carried them.

Versions are monotonic across methods within a lineage: a MEMORY push, a
CHECKPOINT registration or an NCCL transfer must carry a version at least as
new as the newest committed one. Only a rewind (`Synchronizer.rewind`) drops
the versions above a point, and starts a new lineage there. Only metadata lives here (it is persisted); the bytes
of MEMORY versions live in `buffers.WeightStore` and may be lost on restart.

With each version the catalog records what a replica's update is judged against (GetVersion): its
identity, each tensor's identity digest and the trainer's probe, as the publisher sent them. Tensor
digests are recorded only when they compose to the identity (`checked_digests`), so a replica that
verifies tensor by tensor and one that verifies the whole version agree on what the version is.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from flywheel.codec.identity import IDENTITY_BYTES, version_digest
from flywheel.errors import InvalidArgument
from flywheel.probe import ProbeBatch
from flywheel.synchronizer.types import Method


@dataclass
class VersionRecord:
    version: int
    method: Method
    #: Size of the weights, in bytes (0 when unknown).
    nbytes: int = 0
    #: Checkpoint directory (CHECKPOINT).
    path: str = ""
    committed_unix_ms: int = 0
    #: The version's identity (flywheel.codec.identity; b"" when the publisher sent none).
    identity: bytes = b""
    #: The lineage (rewinds so far) it was committed in.
    epoch: int = 0
    #: Each tensor's identity digest, composing to `identity` (empty: the publisher sent none).
    tensors: dict[str, bytes] = field(default_factory=dict)
    #: The trainer's log-probs of the probe batch under this version (None: none was published).
    probe: ProbeBatch | None = None


def checked_digests(identity: bytes, tensors: Mapping[str, bytes], what: str) -> dict[str, bytes]:
    """`tensors` (name -> identity digest) when they compose to `identity` (flywheel.codec.identity);
    InvalidArgument naming `what` otherwise. None at all is fine: an older publisher sends none."""
    if not tensors:
        return {}
    if not identity:
        raise InvalidArgument(f"{what}: {len(tensors)} tensor digests without the identity they compose to")
    for name, digest in tensors.items():
        if not name:
            raise InvalidArgument(f"{what}: a tensor digest without a tensor name")
        if len(digest) != IDENTITY_BYTES:
            raise InvalidArgument(f"{what}: tensor {name!r}: a digest is {IDENTITY_BYTES} bytes (XXH3-128), "
                                  f"got {len(digest)}")
    composed = version_digest(tensors)
    if composed != identity:
        raise InvalidArgument(f"{what}: the {len(tensors)} tensor digests compose to {composed.hex()[:16]}, not to "
                              f"the identity {identity.hex()[:16]} they come with (a publisher's bug, or another "
                              "version's digests)")
    return dict(tensors)


class VersionCatalog:
    def __init__(self, max_records: int = 256) -> None:
        self.max_records = max_records
        self.records: dict[int, VersionRecord] = {}
        #: Versions rewinds dropped that nothing committed again since: a replica reporting one holds
        #: a lost lineage's weights. The store keeps them with the lineage (Store.save_lineage).
        self.dropped: set[int] = set()

    @property
    def latest(self) -> int:
        return max(self.records, default=0)

    def latest_record(self) -> VersionRecord | None:
        return self.records.get(self.latest)

    def get(self, version: int) -> VersionRecord | None:
        return self.records.get(version or self.latest)

    def newest_of(self, method: Method) -> VersionRecord | None:
        found = [r for r in self.records.values() if r.method == method]
        return max(found, key=lambda r: r.version) if found else None

    def commit(self, record: VersionRecord) -> None:
        if not record.committed_unix_ms:
            record.committed_unix_ms = int(time.time() * 1000)
        self.records[record.version] = record
        self.dropped.discard(record.version)
        for version in sorted(self.records)[: -self.max_records]:
            del self.records[version]

    def drop_above(self, version: int) -> list[int]:
        """Forgets every version above `version` (a rewind); returns them, oldest first."""
        dropped = sorted(v for v in self.records if v > version)
        for v in dropped:
            del self.records[v]
        self.dropped.update(dropped)
        return dropped

    def why_missing(self, version: int, epoch: int, rewound_to: int) -> str:
        """Why `version` has no record in this lineage, in words (for a NOT_FOUND or a refusal)."""
        if version in self.dropped:
            return (f"version {version} was dropped by a rewind (the last went back to version {rewound_to}, "
                    f"lineage {epoch})")
        if self.records and version < min(self.records):
            return f"version {version} is older than the oldest version kept ({min(self.records)}): its record was evicted"
        return f"version {version} has not been committed in lineage {epoch} (newest committed: {self.latest})"

    def restore(self, records: list[VersionRecord]) -> None:
        for r in records:
            self.records[r.version] = r

    def ordered(self) -> list[VersionRecord]:
        return [self.records[v] for v in sorted(self.records)]
