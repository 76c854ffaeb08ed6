"""Keeps glibc malloc from returning chunk-sized buffers to the kernel.

Streaming a version allocates and frees a few megabyte-sized buffers per chunk
(the payload bytes, the protobuf message's arena, the bytes read back out of
it). With glibc's defaults, a free that leaves more than ~2 MiB at the top of
the heap trims it back to the kernel, and the next chunk's allocation faults
fresh zeroed pages in again: on a 2-core VM that made every copy of the codec
3-5x slower (bench/codec.py). Raising the trim threshold and pinning the mmap
threshold above the largest chunk keeps those buffers in the heap, hot in
cache, from one chunk to the next.

This is process-wide: up to TRIM_THRESHOLD_BYTES of freed memory stays with the
process, and allocations below MMAP_THRESHOLD_BYTES come from the heap (what
glibc's own dynamic threshold converges to anyway). It is applied once, on
first use of the encoder or assembler; elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

# glibc <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations up to this size come from the heap; above every chunk
#: (MAX_CHUNK_BYTES < 4 MiB) plus its message overhead.
MMAP_THRESHOLD_BYTES = 8 << 20
#: Free memory kept at the top of the heap before trimming.
TRIM_THRESHOLD_BYTES = 64 << 20

_lock = threading.Lock()
_applied: bool | None = None


def tune_allocator() -> bool:
    """Apply the thresholds once per process; True if glibc accepted them."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # Both must be set: setting either disables glibc's dynamic adjustment of
    # the other, and a 128 KiB mmap threshold would mmap every chunk.
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
