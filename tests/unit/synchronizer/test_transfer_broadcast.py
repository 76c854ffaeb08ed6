"""flywheel.transfer.broadcast over gloo, ranks as threads of this process."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flywheel.errors import Aborted, DeadlineExceeded, InvalidArgument
from flywheel.transfer.broadcast import GroupSpec, apply_staged, plan, receive, send
from tests.unit.synchronizer.sync_helpers import small_state

_port = iter(range(42000 + os.getpid() % 500 * 8, 42000 + os.getpid() % 500 * 8 + 8))


def spec(rank: int, world: int, port: int, seconds: float = 20.0) -> GroupSpec:
    return GroupSpec(f"g{port}", f"127.0.0.1:{port}", world, rank, "gloo", time.time() + seconds, 1)


def test_plan_aligns_and_packs() -> None:
    metas = [("a", torch.float32, (3,)), ("b", torch.bfloat16, (100,)), ("c", torch.int64, ())]
    slots, sizes = plan(metas, 128)
    assert [(s.bucket, s.offset, s.nbytes) for s in slots] == [(0, 0, 12), (1, 0, 200), (2, 0, 8)]
    assert sizes == [64, 256, 64] and all(s.offset % 64 == 0 for s in slots)


def test_two_receivers_get_the_weights_bit_exact() -> None:
    state = small_state(3, scale=50)
    port = next(_port)
    live = [{k: torch.zeros_like(v) for k, v in state.items()} for _ in range(2)]
    buckets: list[int] = []
    with ThreadPoolExecutor(3) as pool:
        sent = pool.submit(send, spec(0, 3, port), state, bucket_bytes=4096, on_bucket=buckets.append)
        staged = [pool.submit(receive, spec(r + 1, 3, port), live[r]) for r in range(2)]
        nbytes = sent.result(60)
        results = [f.result(60) for f in staged]
    assert nbytes >= sum(t.numel() * t.element_size() for t in state.values()) and buckets == [0, 1]
    for got, dest in zip(results, live):
        assert all(torch.equal(dest[k], torch.zeros_like(v)) for k, v in state.items())  # staged, not applied
        apply_staged(got, dest)
        for k, v in state.items():
            assert torch.equal(dest[k].view(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def test_a_mismatched_receiver_aborts_the_sender() -> None:
    state = small_state()
    port = next(_port)
    wrong = {k: torch.zeros_like(v) for k, v in state.items()}
    wrong["embed.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(send, spec(0, 2, port), state)
        got = pool.submit(receive, spec(1, 2, port), wrong)
        with pytest.raises(InvalidArgument, match="embed.weight"):
            got.result(60)
        with pytest.raises((Aborted, RuntimeError)):
            sent.result(60)


def seconds_to_abort(call: Callable[[Callable[[], bool]], object], match: str) -> float:
    """How long `call(should_abort)` takes to raise Aborted (matching `match`) once its flag rises at 0.3 s."""
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()
    started = time.monotonic()
    with pytest.raises(Aborted, match=match):
        call(flag.is_set)
    return time.monotonic() - started


def test_rendezvous_honours_abort_and_deadline() -> None:
    port = next(_port)
    # the receiver never comes
    assert seconds_to_abort(lambda aborted: send(spec(0, 2, port), small_state(), should_abort=aborted), "aborted") < 5
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        send(spec(0, 2, port, seconds=1.0), small_state())
    assert time.monotonic() - started < 5


def test_a_receiver_that_arrives_first_waits_on_the_port_and_hears_an_abort_at_once() -> None:
    """Before the sender's store listens, a receiver polls the port (not a TCPStore client, which blocks for
    its whole connect timeout, 2 s here, and then backs off), so it joins the moment the store is up and an
    abort reaches it within a poll."""
    port = next(_port)
    # the sender never comes
    assert seconds_to_abort(lambda aborted: receive(spec(1, 2, port), small_state(), should_abort=aborted),
                            "rendezvous") < 1.0

    state = small_state()
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with ThreadPoolExecutor(2) as pool:
        got = pool.submit(receive, spec(1, 2, port), live)
        time.sleep(0.3)  # the receiver is waiting on a port nobody listens on yet
        sent = pool.submit(send, spec(0, 2, port), state)
        apply_staged(got.result(60), live)
        sent.result(60)
    assert all(torch.equal(live[k], v) for k, v in state.items())


def test_the_rendezvous_listens_on_its_interface_only_and_only_during_the_transfer() -> None:
    import socket

    import psutil

    state = small_state()
    port = next(_port)
    seen: list[set[str]] = []

    def listening(_bucket: int) -> None:
        seen.append({c.laddr.ip for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port})

    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(send, spec(0, 2, port), state, on_bucket=listening)
        got = pool.submit(receive, spec(1, 2, port), live)
        sent.result(60), got.result(60)
    assert seen and all(ips == {"127.0.0.1"} for ips in seen)  # not 0.0.0.0 / ::
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))
