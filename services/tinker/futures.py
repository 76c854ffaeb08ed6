"""The Tinker futures protocol: every training call answers at once with a
request id, runs later, and its result is fetched with retrieve_future.

A retrieve waits (long-polls) up to `long_poll_seconds`, below the SDK's
45 s read timeout, then answers `try_again`. A failed request's answer is
`{"error", "category"}`: "user" for a request that can never succeed as sent
(the SDK raises at once), "server" for anything else.

A request belongs to the tenant that made it: another tenant's id is not
found. A sample may be cancelled (`cancel_future`, what the SDK sends for a
sample it stopped waiting for): its work stops and it answers "cancelled".
Requests that run on the trainer are not cancelled half way (a gradient
half accumulated would be left behind): cancelling one is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from flywheel.errors import (
    AlreadyExists, FailedPrecondition, FlywheelError, InvalidArgument, NotFound, PermissionDenied,
)
from services.tinker import metrics

log = logging.getLogger(__name__)

#: The requests a client may cancel.
CANCELLABLE = frozenset({"sample"})
#: A request's error the client caused: sending it again unchanged cannot succeed.
USER_ERRORS = (InvalidArgument, FailedPrecondition, NotFound, AlreadyExists, PermissionDenied)


@dataclass(frozen=True)
class Outcome:
    """A finished request: a JSON object, protobuf bytes (forward_backward's), or an error."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "server"

    def reply(self) -> dict:
        """The JSON answer of a finished request (protobuf results are sent as they are)."""
        if self.error is not None:
            return {"error": self.error, "category": self.category}
        return dict(self.json or {})


def failure(exc: BaseException) -> Outcome:
    if isinstance(exc, USER_ERRORS):
        return Outcome(error=str(exc), category="user")
    if isinstance(exc, FlywheelError):
        return Outcome(error=f"{exc.code}: {exc}", category="server")
    log.exception("a Tinker request failed", exc_info=exc)
    return Outcome(error=f"internal error: {type(exc).__name__}: {exc}", category="server")


class Futures:
    """Request id -> its outcome once known. Finished outcomes are kept for
    `keep_seconds` after they finish (a client may fetch one more than once)."""

    def __init__(self, keep_seconds: float = 3600.0) -> None:
        self.keep_seconds = keep_seconds
        self._pending: dict[str, asyncio.Future[Outcome]] = {}
        self._finished: dict[str, tuple[float, Outcome]] = {}
        self._owners: dict[str, tuple[str, str]] = {}  # request id -> (tenant, kind)
        self._tasks: dict[str, asyncio.Task] = {}
        self._ids = itertools.count(1)

    def new(self, label: str, tenant: str) -> str:
        """A new request id of `tenant`'s, pending until `finish`."""
        request_id = f"{label}-{next(self._ids)}"
        self._pending[request_id] = asyncio.get_running_loop().create_future()
        self._owners[request_id] = (tenant, label)
        return request_id

    def _check(self, request_id: str, tenant: str) -> str:
        """The request's kind, if it is `tenant`'s (another tenant's is not found, as an unknown one)."""
        owner = self._owners.get(request_id)
        if owner is None or owner[0] != tenant:
            raise NotFound(f"request {request_id!r} is not known here (never made, or its result expired)")
        return owner[1]

    def cancel(self, request_id: str, tenant: str) -> None:
        """Stops a pending sample; it answers that it was cancelled. One finished already stays as it is."""
        kind = self._check(request_id, tenant)
        if kind not in CANCELLABLE:
            raise InvalidArgument(f"request {request_id}: a {kind} request is not cancelled here (it runs on the "
                                  f"trainer, whose state would be left half changed); only {', '.join(CANCELLABLE)}")
        task = self._tasks.get(request_id)
        if request_id in self._pending and task is not None:
            task.cancel()

    def finish(self, request_id: str, outcome: Outcome) -> None:
        waiter = self._pending.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)
        self._finished[request_id] = (time.monotonic(), outcome)
        self._forget_old()

    def run(self, request_id: str, work: Callable[[], Awaitable[Outcome]]) -> asyncio.Task:
        """Runs `work` now and finishes `request_id` with its outcome (or its failure)."""
        kind = self._owners[request_id][1]

        async def runner() -> None:
            started = time.monotonic()
            try:
                outcome = await work()
            except asyncio.CancelledError:
                if request_id not in self._pending:  # the gateway is closing
                    raise
                outcome = Outcome(error=f"request {request_id} was cancelled by the client", category="user")
            except Exception as exc:
                outcome = failure(exc)
            finally:
                self._tasks.pop(request_id, None)
            metrics.WORK.labels(kind).observe(time.monotonic() - started)
            if outcome.error is not None:
                metrics.FAILURES.labels(kind, outcome.category).inc()
            self.finish(request_id, outcome)

        task = self._tasks[request_id] = asyncio.create_task(runner(), name=f"tinker {request_id}")
        return task

    async def wait(self, request_id: str, tenant: str, seconds: float) -> Outcome | None:
        """The outcome, waiting up to `seconds` for it; None if it is still running."""
        self._check(request_id, tenant)
        kept = self._finished.get(request_id)
        if kept is not None:
            return kept[1]
        waiter = self._pending.get(request_id)
        if waiter is None:
            raise NotFound(f"request {request_id!r} is not known here (never made, or its result expired)")
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), seconds)
        except asyncio.TimeoutError:
            return None

    def _forget_old(self) -> None:
        cutoff = time.monotonic() - self.keep_seconds
        for request_id in [r for r, (at, _) in self._finished.items() if at < cutoff]:
            del self._finished[request_id]
            self._owners.pop(request_id, None)

    def held(self) -> int:
        """Requests whose id is known (pending, or finished and kept)."""
        return len(self._owners)
