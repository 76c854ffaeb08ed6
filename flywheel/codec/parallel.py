"""Spreads the codec's bulk byte work (hashing, big copies) over a few threads.

xxhash and numpy's copies release the GIL, so a small shared pool gets real
parallelism for the two passes that touch a whole model at once: the
encoder's checksum pass and the assembler's commit copy. Work is cut into
pieces of PIECE_BYTES and handed out dynamically, so a worker stalled by a
busy core delays only its current piece (unlike a static OpenMP split, whose
barrier waits for the slowest thread: 5-10x slower on a shared 2-core host).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

#: Threads of the pool; memory bandwidth saturates after a few.
WORKERS = max(1, min(4, os.cpu_count() or 1))
#: Granularity of parallel copies; big enough to amortise dispatch (~10 us).
PIECE_BYTES = 8 << 20

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _forget_pool_in_child() -> None:
    # A forked child inherits the pool object but not its threads; work
    # submitted to it would never run. Start a fresh pool on first use.
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def codec_pool() -> ThreadPoolExecutor | None:
    """The shared pool (None on a single core, where it would only add dispatch)."""
    return _executor()


def _executor() -> ThreadPoolExecutor | None:
    global _pool
    if WORKERS == 1:
        return None
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="flywheel-codec")
        return _pool


def _hash_batch(buffers: Sequence[memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(b) for b in buffers]


def hash_many(buffers: Sequence[memoryview]) -> list[int]:
    """XXH3-64 of each buffer, in order; spread over the pool when worth it."""
    pool = _executor()
    total = sum(len(b) for b in buffers)
    if pool is None or len(buffers) < 2 or total < 2 * PIECE_BYTES:
        return _hash_batch(buffers)
    # A few batches per worker: few enough that dispatch is noise next to
    # hashing, enough that a worker stalled on a busy core is not a barrier.
    n_batches = min(len(buffers), 4 * WORKERS)
    bounds = [len(buffers) * k // n_batches for k in range(n_batches + 1)]
    batches = [buffers[lo:hi] for lo, hi in itertools.pairwise(bounds)]
    return [h for batch in pool.map(_hash_batch, batches) for h in batch]


def copy_pairs(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """dst[:] = src for every (dst, src) pair of equal-length uint8 arrays."""
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for dst, src in pairs:
        for start in range(0, len(dst), PIECE_BYTES):
            pieces.append((dst[start : start + PIECE_BYTES], src[start : start + PIECE_BYTES]))
    pool = _executor()
    if pool is None or len(pieces) < 2:
        for dst, src in pieces:
            np.copyto(dst, src)
        return
    for _ in pool.map(lambda p: np.copyto(p[0], p[1]), pieces):
        pass
