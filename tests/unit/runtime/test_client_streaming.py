"""client_streaming_call: a status grpc's asyncio client lost to a racing write
is asked for again; the server's own statuses are never retried."""

from __future__ import annotations

import grpc
import pytest

from flywheel.runtime.client import client_streaming_call


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class ScriptedCall:
    """A stream-unary callable answering from a script; records what each send streamed."""

    def __init__(self, *answers: object) -> None:
        self.answers, self.sent, self.timeouts = list(answers), [], []

    async def __call__(self, requests, timeout):
        self.sent.append(list(requests))
        self.timeouts.append(timeout)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


LOST = rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core")


async def test_a_lost_status_is_asked_for_again_with_fresh_requests_within_one_deadline() -> None:
    refused = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "segment refused")
    call = ScriptedCall(LOST, refused)
    fresh = iter(range(10))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client_streaming_call(call, lambda: [next(fresh), next(fresh)], timeout=5.0)
    assert raised.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert call.sent == [[0, 1], [2, 3]]  # each send streams what a new iterator gives
    assert all(0 < t <= 5.0 for t in call.timeouts) and call.timeouts[1] <= call.timeouts[0]


async def test_a_response_after_a_lost_status_is_returned() -> None:
    call = ScriptedCall(LOST, "response")
    assert await client_streaming_call(call, lambda: [b"frame"], timeout=5.0) == "response"


@pytest.mark.parametrize("error", [
    rpc_error(grpc.StatusCode.INTERNAL, "the server's own internal error"),
    rpc_error(grpc.StatusCode.DATA_LOSS, "chunk 3 corrupted"),
    rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"),
])
async def test_the_servers_statuses_are_never_sent_again(error) -> None:
    call = ScriptedCall(error, "response")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client_streaming_call(call, lambda: [b"frame"], timeout=5.0)
    assert raised.value is error and len(call.sent) == 1


async def test_a_status_lost_every_time_is_reported_after_the_last_try() -> None:
    call = ScriptedCall(LOST, LOST, LOST, "never reached")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client_streaming_call(call, lambda: [b"frame"], timeout=5.0, tries=3)
    assert raised.value is LOST and len(call.sent) == 3
