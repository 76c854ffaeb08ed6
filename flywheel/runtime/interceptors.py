"""Server interceptors: bearer-token auth with scopes (flywheel.runtime.auth), and domain-error to status mapping
(with per-method metrics).

Requests that do not decode, or hold enum values their schema does not
define, are refused with INVALID_ARGUMENT before the handler runs
(flywheel.runtime.requests).

Handlers raise `flywheel.errors.FlywheelError` subclasses (or codec errors,
which carry a `code` too); the error interceptor aborts the call with the
matching `grpc.StatusCode` and the message as details. Handlers never have to
know about status codes, and nothing is logged-and-swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from flywheel.errors import FlywheelError
from flywheel.runtime import requests
from flywheel.runtime.auth import Scope, TokenScopes, refusal
from flywheel.runtime.metrics import RPC_DURATION, RPC_REQUESTS

log = logging.getLogger(__name__)

# The health service must answer load balancers and probes that hold no token.
AUTH_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details a domain exception should reach the client as."""
    code_name = getattr(exc, "code", None)
    if isinstance(exc, FlywheelError) or (isinstance(code_name, str) and code_name in grpc.StatusCode.__members__):
        return grpc.StatusCode[code_name], str(exc)
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "not implemented"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if isinstance(exc, grpc.aio.AioRpcError):
        # A downstream call failed: pass its status on, saying where it came from.
        return exc.code(), f"upstream call failed: {exc.details()}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _method_name(full_method: str) -> str:
    return full_method.rsplit("/", 1)[-1]


def _rebuild(
    handler: grpc.RpcMethodHandler, unary: Callable, streaming: Callable,
    deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of the same kind whose behaviour (and, if given, request deserializer) is wrapped."""
    kw = dict(request_deserializer=deserializer or handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kw)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kw)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes and records per-method count and latency."""

    def __init__(self, service: str) -> None:
        self.service = service

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = _method_name(details.method)
        # Requests are checked as they are decoded (flywheel.runtime.requests) and refused here, inside
        # the wrapper that turns errors into statuses: a stream's requests one by one as the handler reads.
        admit = requests.admit_each if handler.request_streaming else requests.admit
        return _rebuild(handler, lambda b: self._unary(b, method, admit), lambda b: self._streaming(b, method, admit),
                        requests.checked(handler.request_deserializer))

    async def _fail(self, exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
        code, message = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("unhandled error in %s", method, exc_info=exc)
        await context.abort(code, message)

    def _record(self, method: str, started: float, code: str) -> None:
        RPC_REQUESTS.labels(self.service, method, code).inc()
        RPC_DURATION.labels(self.service, method).observe(time.perf_counter() - started)

    @staticmethod
    def _code_of(context: grpc.aio.ServicerContext) -> str:
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"

    @contextlib.asynccontextmanager
    async def _outcome(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Around one call: records its status and latency, and turns an exception into its status."""
        started = time.perf_counter()
        try:
            yield
        except grpc.aio.AbortError:
            self._record(method, started, self._code_of(context))
            raise
        except asyncio.CancelledError:
            self._record(method, started, "CANCELLED")
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            self._record(method, started, status_for(exc)[0].name)
            await self._fail(exc, context, method)
        else:
            self._record(method, started, "OK")

    def _unary(self, behaviour: Callable[..., Any], method: str, admit: Callable[[Any], Any]
               ) -> Callable[..., Awaitable[Any]]:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._outcome(method, context):
                result = behaviour(admit(request), context)
                if inspect.isawaitable(result):
                    result = await result
            return result

        return wrapper

    def _streaming(self, behaviour: Callable[..., Any], method: str, admit: Callable[[Any], Any]
                   ) -> Callable[..., AsyncIterator[Any]]:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with self._outcome(method, context):
                result = behaviour(admit(request), context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        yield item
                else:
                    # A coroutine that writes with context.write(), or a sync iterator.
                    result = await result if inspect.isawaitable(result) else result
                    for item in result or ():
                        yield item

        return wrapper


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits a call whose `authorization: Bearer <token>` names one of `tokens` of a scope
    the method allows. No or an unknown token: UNAUTHENTICATED; a token whose scope is too
    small: PERMISSION_DENIED, naming the scope the method needs.

    `method_scopes` maps full method names ("/pkg.Service/Method") to the least scope
    that may call them; a method it does not name needs OPERATOR."""

    def __init__(self, tokens: TokenScopes, method_scopes: Mapping[str, Scope]) -> None:
        self._tokens = tokens
        self._method_scopes = method_scopes

    def _refusal(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str] | None:
        given = next((value for key, value in details.invocation_metadata or () if key == "authorization"), None)
        held = self._tokens.scope_of(given)
        if held is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"
        needed = self._method_scopes.get(details.method, Scope.OPERATOR)
        if held < needed:
            return grpc.StatusCode.PERMISSION_DENIED, refusal(_method_name(details.method), needed, held)
        return None

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(AUTH_EXEMPT_PREFIXES):
            return handler
        refused = self._refusal(details)
        if refused is None:
            return handler
        code, message = refused

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator

        return _rebuild(handler, lambda _b: deny, lambda _b: deny_stream)
