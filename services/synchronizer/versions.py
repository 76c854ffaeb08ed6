"""The catalog of committed weight versions, whatever method carried them.

Versions are monotonic across methods within a lineage: a MEMORY push, a
CHECKPOINT registration or an NCCL transfer must carry a version at least as
new as the newest committed one. Only a rewind (`Synchronizer.rewind`) drops
the versions above a point, and starts a new lineage there. Only metadata lives here (it is persisted); the bytes
of MEMORY versions live in `buffers.WeightStore` and may be lost on restart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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

    def restore(self, records: list[VersionRecord]) -> None:
        for r in records:
            self.records[r.version] = r

    def ordered(self) -> list[VersionRecord]:
        return [self.records[v] for v in sorted(self.records)]
