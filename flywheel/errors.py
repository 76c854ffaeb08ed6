"""Domain errors shared by every service.

Domain code raises these; it never imports grpc. The runtime's error
interceptor turns each into the gRPC status named by its `code` (and the HTTP
layer into the matching HTTP status), with the message as the details, so a
handler raises instead of logging and carrying on.
"""

from __future__ import annotations


class FlywheelError(Exception):
    """Base of every error that should reach a client with a specific status."""

    #: Name of the grpc.StatusCode this error maps to.
    code: str = "INTERNAL"


class InvalidArgument(FlywheelError):
    """The request itself is wrong (a field's value, shape, dtype...)."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(FlywheelError):
    """The request is well formed but the system is not in a state to serve it."""

    code = "FAILED_PRECONDITION"


class NotFound(FlywheelError):
    code = "NOT_FOUND"


class AlreadyExists(FlywheelError):
    code = "ALREADY_EXISTS"


class ResourceExhausted(FlywheelError):
    """A bounded queue or memory limit is full; the client should retry later."""

    code = "RESOURCE_EXHAUSTED"


class DataLoss(FlywheelError):
    """Bytes arrived corrupt, truncated or incomplete."""

    code = "DATA_LOSS"


class DeadlineExceeded(FlywheelError):
    code = "DEADLINE_EXCEEDED"


class Aborted(FlywheelError):
    """The operation was abandoned (e.g. a transfer another participant failed)."""

    code = "ABORTED"


class Unavailable(FlywheelError):
    """A dependency is down; retrying later may succeed."""

    code = "UNAVAILABLE"


class Unauthenticated(FlywheelError):
    code = "UNAUTHENTICATED"


class PermissionDenied(FlywheelError):
    """The caller may not do this (a path outside the service's directories, a scope too narrow)."""

    code = "PERMISSION_DENIED"


#: The HTTP status of each error code, for the HTTP APIs (the rollout's, the Tinker gateway's).
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "FAILED_PRECONDITION": 409, "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}
