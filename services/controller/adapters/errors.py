"""gRPC status codes -> the domain errors the pipeline reasons about.

The pipeline fails over on `Unavailable` / `DeadlineExceeded`, skips a batch
on `InvalidArgument`, and so on; adapters raise those instead of
`grpc.aio.AioRpcError`, so no domain module needs to know grpc.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from flywheel import errors as fe

_BY_CODE: dict[grpc.StatusCode, type[fe.FlywheelError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: fe.InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: fe.FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: fe.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: fe.AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: fe.ResourceExhausted,
    grpc.StatusCode.DATA_LOSS: fe.DataLoss,
    grpc.StatusCode.DEADLINE_EXCEEDED: fe.DeadlineExceeded,
    grpc.StatusCode.ABORTED: fe.Aborted,
    grpc.StatusCode.UNAVAILABLE: fe.Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: fe.Unauthenticated,
}


def domain_error(exc: grpc.aio.AioRpcError, what: str) -> fe.FlywheelError:
    cls = _BY_CODE.get(exc.code(), fe.FlywheelError)
    return cls(f"{what}: {exc.code().name}: {exc.details()}")


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Re-raises an RPC failure as the matching domain error, naming the call."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise domain_error(exc, what) from None
