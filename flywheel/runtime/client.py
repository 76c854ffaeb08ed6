"""Client channels with the options every Flywheel client must use.

`open_channel(address)` returns a `grpc.aio.Channel` that
- attaches `authorization: Bearer <token>` to every call (token from the
  argument or FLYWHEEL_AUTH_TOKEN / FLYWHEEL_AUTH_TOKEN_FILE),
- gives every call a deadline (`default_timeout` unless the caller set one:
  a call without a deadline can hang a whole pipeline),
- retries UNAVAILABLE with exponential backoff (gRPC's own retry machinery,
  configured through the service config),
- sets keepalive and message sizes the same way servers do,
- uses TLS, verifying the server, when the process has a CA
  (flywheel.runtime.tls).

`translated(what)` / `domain_error(exc, what)` turn a failed call into the
`flywheel.errors` exception of its status code (the one mapping every client
uses), so no domain code needs to know grpc.

`ChannelClient` is the typed clients' base: their channel's lifetime (`close`,
`async with`).

`client_streaming_call(...)` makes a client-streaming call and gives back the
server's status, not the one grpc's asyncio client puts in its place when the
server ends the call while a write is in flight (`lost_status`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc

from flywheel import errors

from flywheel.runtime.auth import resolve_token
from flywheel.runtime.channel_options import client_options
from flywheel.runtime.server_config import MIB
from flywheel.runtime.tls import TlsFiles, channel_credentials, process_tls

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 30.0

#: The details grpc's asyncio client gives a call whose write failed in Core. When a
#: server ends a client-streaming call early (it refused the request) while the client
#: is still writing, the failed write's INTERNAL can replace the status the server sent
#: (grpc/grpc#36066; about 2 % of early refusals here, with grpcio 1.85).
_LOST_STATUS_DETAILS = "Internal error from Core"
#: Sends of a client-streaming call whose server status was lost that way: five, because on a loaded
#: machine the race is won more often than 2 % (one push in 300 of the early-refusal test ended
#: INTERNAL with three, in a full suite on two busy cores); a lost answer costs a resend of frames
#: the server refuses at the second.
CLIENT_STREAMING_TRIES = 5

#: Status code name -> the domain error raised for it (anything else: FlywheelError).
_ERRORS: dict[str, type[errors.FlywheelError]] = {
    cls.code: cls
    for cls in (
        errors.InvalidArgument, errors.FailedPrecondition, errors.NotFound, errors.AlreadyExists,
        errors.ResourceExhausted, errors.DataLoss, errors.DeadlineExceeded, errors.Aborted,
        errors.Unavailable, errors.Unauthenticated, errors.PermissionDenied,
    )
}


def domain_error(exc: grpc.aio.AioRpcError, what: str) -> errors.FlywheelError:
    """The domain exception for a failed call: its class by status code, `code` set, the details as message."""
    code = exc.code().name
    err = _ERRORS.get(code, errors.FlywheelError)(f"{what}: {exc.details() or code}")
    err.code = code
    return err


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Re-raises a failed call as its domain error, naming the call (`what`)."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise domain_error(exc, what) from None


def lost_status(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call's status is the client's own write failure, not the server's."""
    return exc.code() is grpc.StatusCode.INTERNAL and exc.details() == _LOST_STATUS_DETAILS


async def client_streaming_call(
    method: grpc.aio.StreamUnaryMultiCallable, requests: Callable[[], Iterable[Any]], timeout: float,
    tries: int = CLIENT_STREAMING_TRIES,
) -> Any:
    """The response of a client-streaming call, or the AioRpcError with the server's status.

    Where the server's status was lost (`lost_status`), the server ended the
    call before the client finished sending, so it accepted nothing: the call
    is sent again from a fresh `requests()`, within the same deadline, to
    learn the server's answer.
    """
    deadline = time.monotonic() + timeout
    for attempt in range(1, tries + 1):
        try:
            return await method(requests(), timeout=max(0.0, deadline - time.monotonic()))
        except grpc.aio.AioRpcError as exc:
            if not lost_status(exc) or attempt == tries or time.monotonic() >= deadline:
                raise
            log.info("a write raced the server's early answer; sending the call again to learn it",
                     extra={"attempt": attempt})
    raise AssertionError("unreachable")


def retry_service_config(max_attempts: int = 5, initial_backoff_s: float = 0.2, max_backoff_s: float = 5.0) -> str:
    """A service config that retries UNAVAILABLE on every method."""
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{}],
                    "retryPolicy": {
                        "maxAttempts": max_attempts,
                        "initialBackoff": f"{initial_backoff_s}s",
                        "maxBackoff": f"{max_backoff_s}s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


class _CallDefaults:
    """Adds the bearer token and a default deadline to a call's details."""

    def __init__(self, token: str | None, default_timeout: float) -> None:
        self._auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._default_timeout = default_timeout

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._auth)
        timeout = details.timeout if details.timeout is not None else self._default_timeout
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )


# grpc.aio sorts a channel's interceptors by kind with an if/elif chain, so one
# object implementing all four kinds would only see unary-unary calls: each
# kind gets its own class.
class _UnaryUnaryDefaults(_CallDefaults, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[override]
        return await continuation(self._details(details), request)


class _UnaryStreamDefaults(_CallDefaults, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[override]
        return await continuation(self._details(details), request)


class _StreamUnaryDefaults(_CallDefaults, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[override]
        return await continuation(self._details(details), request_iterator)


class _StreamStreamDefaults(_CallDefaults, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[override]
        return await continuation(self._details(details), request_iterator)


def open_channel(
    address: str,
    *,
    token: str | None = None,
    default_timeout: float = DEFAULT_TIMEOUT_SECONDS,
    max_message_bytes: int = 64 * MIB,
    max_attempts: int = 5,
    extra_options: Sequence[tuple[str, Any]] = (),
    tls: TlsFiles | None = None,
) -> grpc.aio.Channel:
    """An aio channel with auth, deadlines, retries and keepalive; TLS verifying the server when
    `tls` (default: this process's, flywheel.runtime.tls) has a CA."""
    options = [*client_options(max_message_bytes), *extra_options]
    if max_attempts > 1:  # gRPC rejects a retry policy of fewer than 2 attempts
        options.append(("grpc.service_config", retry_service_config(max_attempts)))
    interceptors = [
        kind(resolve_token(token), default_timeout)
        for kind in (_UnaryUnaryDefaults, _UnaryStreamDefaults, _StreamUnaryDefaults, _StreamStreamDefaults)
    ]
    credentials = channel_credentials(tls if tls is not None else process_tls())
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


_Client = TypeVar("_Client", bound="ChannelClient")


class ChannelClient:
    """A typed client over one channel (`self.channel`, from `open_channel`): `close()` closes it,
    and `async with client:` closes it on the way out."""

    channel: grpc.aio.Channel

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self: _Client) -> _Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
