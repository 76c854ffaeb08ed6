"""Errors of the weight codec: one hierarchy under `CodecError`.

Each class also derives from the shared `flywheel.errors` class of its status
(`DataLoss`, `InvalidArgument`, `FailedPrecondition`), which gives it its
`code` (CodecError sets none): the runtime's error interceptor maps it to the
right gRPC status without knowing the codec, and callers can catch either
"any codec error" or "any data loss".

Status codes:
  DATA_LOSS        the stream as received is not the version that was sent:
                   corrupt bytes, missing/duplicated/misordered chunks,
                   truncation, digest mismatch. Re-sending may succeed.
  INVALID_ARGUMENT what was sent (or the destination given) contradicts the
                   manifest or is malformed: names, dtypes, shapes, bounds.
  FAILED_PRECONDITION  the assembler was used after it failed or committed.
"""

from __future__ import annotations

from flywheel.errors import DataLoss, FailedPrecondition, FlywheelError, InvalidArgument


class CodecError(FlywheelError):
    """Base of every error the codec raises."""


class UnsupportedDType(CodecError, InvalidArgument):
    """A torch dtype or wire DType the codec cannot carry."""


class InvalidTensor(CodecError, InvalidArgument):
    """A single `Tensor` message whose shape, dtype and byte length disagree."""


class InvalidManifest(CodecError, InvalidArgument):
    """A manifest that contradicts itself (sizes, counts, names, algorithm)."""


class ManifestMismatch(CodecError, InvalidArgument):
    """A chunk or a destination that does not match the manifest: wrong name,
    dtype, shape, version, bucket, range (out of bounds or overlapping)."""


class ChunkCorrupted(CodecError, DataLoss):
    """A chunk's bytes do not hash to its checksum."""


class ChunkMissing(CodecError, DataLoss):
    """Commit was asked for while some chunks never arrived (a hole)."""


class StreamTruncated(ChunkMissing):
    """The stream ended before the final chunk of the version arrived."""


class ChunkDuplicated(CodecError, DataLoss):
    """A chunk sequence number arrived twice."""


class ChunkOutOfOrder(CodecError, DataLoss):
    """A chunk of a later bucket arrived before the current bucket completed."""


class DigestMismatch(CodecError, DataLoss):
    """Every chunk arrived and matched its checksum, but the whole-version
    digest differs from the manifest's (tampered manifest or checksums)."""


class AssemblerClosed(CodecError, FailedPrecondition):
    """The assembler already failed or committed; start a new one."""
