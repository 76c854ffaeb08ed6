"""Staging copies and checksum checks of accepted chunks, off the caller's thread.

A receiver's per-chunk byte work (copy the payload into staging, hash it)
releases the GIL, so it can run on the codec's small thread pool while the
caller's thread parses and checks the next chunk's header: on two cores the
staging of a version then costs about half its wall time. Work is batched
(about `PIECE_BYTES` per task) so dispatch stays negligible.

A checksum mismatch is found a few chunks late: it surfaces at a later
`raise_failed()` or at `finish()`, always before anything is committed.
Every payload handed in must therefore stay unchanged until `finish()`
returns (message objects' bytes and the encoder's pieces do; a reused
receive buffer does not: stage those synchronously).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from flywheel.codec.checker import ChunkChecker
from flywheel.codec.errors import ChunkCorrupted
from flywheel.codec.parallel import PIECE_BYTES

_Item = tuple[int, np.ndarray, np.ndarray, int]  # (sequence, staging bytes, payload bytes, checksum)


def _stage(checker: ChunkChecker, items: Sequence[_Item]) -> ChunkCorrupted | None:
    for seq, staging, payload, checksum in items:
        np.copyto(staging, payload)
        # Hashing what landed in staging (still in cache) proves the staged bytes, not just the payload.
        if error := checker.payload_error(seq, staging, checksum):
            return error
    return None


class BackgroundStager:
    def __init__(self, checker: ChunkChecker, pool: ThreadPoolExecutor) -> None:
        self._checker, self._pool = checker, pool
        self._batch: list[_Item] = []
        self._batch_bytes = 0
        self._pending: deque[Future[ChunkCorrupted | None]] = deque()

    def add(self, seq: int, staging: np.ndarray, payload: np.ndarray, checksum: int) -> None:
        self._batch.append((seq, staging, payload, checksum))
        self._batch_bytes += len(payload)
        if self._batch_bytes >= PIECE_BYTES:
            self._submit()

    def _submit(self) -> None:
        if self._batch:
            self._pending.append(self._pool.submit(_stage, self._checker, self._batch))
            self._batch, self._batch_bytes = [], 0

    def raise_failed(self) -> None:
        """Raises the first mismatch among the tasks already done (after waiting for the rest)."""
        while self._pending and self._pending[0].done():
            if error := self._pending.popleft().result():
                self.wait()
                raise error

    def wait(self) -> ChunkCorrupted | None:
        """Runs everything handed in to completion; the first mismatch, if any.
        Nothing writes staging after this returns."""
        self._submit()
        first = None
        while self._pending:
            error = self._pending.popleft().result()
            first = first or error
        return first

    def finish(self) -> None:
        """Raises the first mismatch once every chunk is staged."""
        if error := self.wait():
            raise error
