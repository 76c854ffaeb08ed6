"""UpdateWeights(nccl) on both engines with a real synchronizer and
a gloo group on 127.0.0.1: the trainer side (rank 0) is the product's
`send_in_group`, the rollout is a real server answering over gRPC.

A committed broadcast moves the rollout to the new version and changes its
greedy output; a misshapen broadcast, a trainer that gives up, a missing
trainer (deadline), an nccl group on a machine without CUDA and a stale
version each leave the old weights serving bit for bit, with the failure on
the synchronizer (the transfer ABORTED); a caller giving up mid-receive
fails the transfer at once and leaves the rollout free for the next one. Tests run in file order on one
server per engine; `Track` follows which weights it serves.

The rollout reads a group from its own synchronizer (`synchronizer.address`; a
request never names one), so each server is configured with an embedded
synchronizer started with it, for the whole module. The server registers
there under its own id (LINK); the tests register the trainer and the
transfer's receiver (ROLLOUT, at the address of that same server) and put
ROLLOUT in their groups: UpdateWeights finds its member by rank, and the
server's follower, watching as LINK, does not join those groups on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from flywheel.common.v1 import common_pb2
from flywheel.models.tiny import build_tiny_model
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from flywheel.runtime.client import open_channel
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.transfer.broadcast import send
from services.rollout.config import RolloutConfig
from flywheel.synchronizer import participant
from flywheel.synchronizer.participant import send_in_group, spec_for
from flywheel.synchronizer.types import GroupInfo, State, TransferState
from tests.conftest import TEST_TOKEN
from flywheel.testing.net import free_port_range
from tests.unit.rollout.rollout_helpers import (
    ServerThread, need_engine, probe_of, reference_greedy, rollout_config, synchronizer_thread,
)

ENGINES = ["transformers", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])]
PROMPT = [318, 268, 223, 20, 284, 223, 21, 33]
STEPS = 12
GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
BUCKET_BYTES = 256 * 1024  # several buckets for the tiny model
TRAINER, ROLLOUT = "trainer-0", "rollout-0"
#: The server's own id at its synchronizer (its presence and follower).
LINK = "rollout-link"


@dataclass
class Track:
    model: Path
    version: int
    state: dict[str, torch.Tensor]

    def scaled(self, factor: float) -> dict[str, torch.Tensor]:
        return {k: v * factor for k, v in load_file(str(self.model / "model.safetensors")).items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rollout-nccl") / "model")


@contextlib.contextmanager
def linked_server(config_of: Callable[[dict], RolloutConfig]) -> Iterator[ServerThread]:
    """A rollout server (`config_of(synchronizer section)`) configured with an embedded synchronizer
    started first, and stopped before it. Its rendezvous ports are a range, handed out in turn: no
    group reuses the port of an earlier test's group, whose rendezvous may not be released at once
    (a sender that failed); one fixed port for the module failed that way, once, with EADDRINUSE."""
    ports = free_port_range(32)
    fields = {"rendezvous_host": "127.0.0.1", "rendezvous_port_min": ports.start,
              "rendezvous_port_max": ports[-1], "lease_seconds": 120}
    with synchronizer_thread(**fields) as sync:
        config = config_of({"address": sync.address, "component_id": LINK})
        srv = ServerThread(config).start()
        srv.sync_address = sync.address
        srv.track = Track(Path(config.engine.model_path), 0, load_file(f"{config.engine.model_path}/model.safetensors"))
        try:
            yield srv
        finally:
            srv.stop()


@pytest.fixture(scope="module", params=ENGINES)
def server(request: pytest.FixtureRequest, model_dir: Path):
    need_engine(request.param)
    with linked_server(lambda link: rollout_config(model_dir, request.param, synchronizer=link)) as srv:
        srv.engine_kind = request.param
        yield srv


@dataclass
class Cluster:
    address: str
    client: SynchronizerClient  # the trainer's (and the test's) client


@contextlib.asynccontextmanager
async def cluster(server: ServerThread) -> AsyncIterator[Cluster]:
    """The server's synchronizer with the trainer and the receiver (ROLLOUT: the server, on the
    version it serves) registered, again for each test."""
    async with SynchronizerClient(server.sync_address, token=TEST_TOKEN) as client:
        await client.register("trainer", TRAINER, address="127.0.0.1:1", capabilities=["nccl"])
        await client.register("rollout", ROLLOUT, address=server.address, capabilities=["nccl"],
                              weight_version=server.track.version)
        yield Cluster(server.sync_address, client)


def nccl_source(group: GroupInfo) -> pb.NcclSource:
    """What the controller's rollout adapter sends (services/controller/adapters/rollout.py); the
    synchronizer is the rollout's own."""
    return pb.NcclSource(
        group_id=group.group_id, rendezvous_address=group.rendezvous_address, world_size=group.world_size,
        rank=group.ranks[ROLLOUT], backend=group.backend,
    )


async def rollout_state(client: SynchronizerClient) -> State:
    return {x.identity.id: x.state for x in (await client.status()).components}[ROLLOUT]


async def greedy(rollout: pb_grpc.RolloutServiceStub) -> common_pb2.Sample:
    response = await rollout.Generate(pb.GenerateRequest(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT))], sampling=GREEDY))
    return response.results[0].samples[0]


async def update(rollout: pb_grpc.RolloutServiceStub, version: int, source: pb.NcclSource) -> pb.UpdateWeightsResponse:
    request = pb.UpdateWeightsRequest(version=version, method=common_pb2.SYNC_METHOD_NCCL, nccl=source)
    return await rollout.UpdateWeights(request, timeout=120)


async def rejected(server, code: grpc.StatusCode | tuple[grpc.StatusCode, ...], update_call) -> str:
    """Runs a failing update; asserts the served weights stay bit for bit what they were."""
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120, max_attempts=1) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        before = await greedy(rollout)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await update_call(rollout)
        assert info.value.code() in (code if isinstance(code, tuple) else (code,)), info.value.details()
        after = await greedy(rollout)
        assert list(after.completion_token_ids) == list(before.completion_token_ids)
        assert list(after.completion_logprobs) == list(before.completion_logprobs)  # the same weights, exactly
        status = await rollout.GetStatus(pb.GetStatusRequest())
        assert status.weight_version == server.track.version and not status.updating and not status.paused
        return info.value.details()


async def test_gloo_broadcast_moves_the_rollout_to_the_new_version(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's worker joins the group itself: the buckets never pass through the service process,
    where the transformers engine receives them."""
    track: Track = server.track
    new = track.scaled(1.5)
    received_here: list[str] = []
    real_receive = participant.receive

    def receive_in_this_process(spec, like, **kwargs):
        received_here.append(spec.group_id)
        return real_receive(spec, like, **kwargs)

    monkeypatch.setattr(participant, "receive", receive_in_this_process)
    async with cluster(server) as c, open_channel(server.address, token=TEST_TOKEN) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        before = await greedy(rollout)
        assert list(before.completion_token_ids) == reference_greedy(track.model, PROMPT, STEPS)
        group = await c.client.allocate_group(1, TRAINER, [ROLLOUT], timeout_seconds=60, backend="gloo")
        sent, response = await asyncio.gather(
            send_in_group(c.client, TRAINER, group, new, bucket_bytes=BUCKET_BYTES, probe=probe_of(server.track.model, new)),
            update(rollout, 1, nccl_source(group)),
        )
        # The sender's own report is listed too when it lands before the commit.
        assert sent.state == TransferState.COMMITTED and ROLLOUT in sent.confirmed
        assert set(sent.confirmed) <= {ROLLOUT, TRAINER}
        assert response.weight_version == 1 and response.bytes == sum(t.nbytes for t in new.values())
        after = await greedy(rollout)
        assert list(after.completion_token_ids) == reference_greedy(track.model, PROMPT, STEPS, new)
        assert list(after.completion_token_ids) != list(before.completion_token_ids)
        assert (after.weight_version_start, after.weight_version_end) == (1, 1)
        status = await c.client.status()
        assert {x.identity.id: x.weight_version for x in status.components}[ROLLOUT] == 1
    assert received_here == ([] if server.engine_kind == "vllm" else [group.group_id])
    track.version, track.state = 1, new


async def test_misshapen_broadcast_is_rejected_and_reported(server) -> None:
    bad = server.track.scaled(2.0)
    bad["model.layers.1.mlp.down_proj.weight"] = bad["model.layers.1.mlp.down_proj.weight"][:, :-1].contiguous()
    async with cluster(server) as c:
        group = await c.client.allocate_group(2, TRAINER, [ROLLOUT], timeout_seconds=60, backend="gloo")
        # The bare broadcast, which reports nothing: the synchronizer's verdict is the rollout's report.
        trainer = asyncio.ensure_future(
            asyncio.to_thread(send, spec_for(group, TRAINER), bad, bucket_bytes=BUCKET_BYTES)
        )
        details = await rejected(server, grpc.StatusCode.INVALID_ARGUMENT,
                                 lambda rollout: update(rollout, 2, nccl_source(group)))
        assert "down_proj" in details
        with pytest.raises(Exception):  # noqa: B017 - the receiver left: an abort or gloo's broken pipe
            await asyncio.wait_for(trainer, 60)
        outcome = await c.client.get_transfer(group.group_id)
        assert outcome.state == TransferState.ABORTED
        assert f"{ROLLOUT} failed: InvalidArgument" in outcome.error and "down_proj" in outcome.error


async def test_trainer_failure_aborts_the_update(server) -> None:
    async with cluster(server) as c:
        group = await c.client.allocate_group(2, TRAINER, [ROLLOUT], timeout_seconds=60, backend="gloo")

        async def trainer_gives_up() -> None:
            # Once the rollout has joined (it waits at the rendezvous), the
            # trainer fails before hosting it.
            while await rollout_state(c.client) != State.WAITING_SYNC:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            await c.client.report_transfer(group.group_id, TRAINER, False, "trainer ran out of memory")

        giving_up = asyncio.ensure_future(trainer_gives_up())
        details = await rejected(server, grpc.StatusCode.ABORTED,
                                 lambda rollout: update(rollout, 2, nccl_source(group)))
        await giving_up
        assert "aborted" in details
        outcome = await c.client.get_transfer(group.group_id)
        assert outcome.state == TransferState.ABORTED and "trainer ran out of memory" in outcome.error


async def test_missing_trainer_times_out_at_the_group_deadline(server) -> None:
    async with cluster(server) as c:
        # Long enough for the rollout to find the group still pending on a busy machine.
        group = await c.client.allocate_group(2, TRAINER, [ROLLOUT], timeout_seconds=4, backend="gloo")
        loop = asyncio.get_running_loop()
        started = loop.time()
        # This rank's rendezvous deadline or the synchronizer's sweep, whichever ends it first.
        await rejected(server, (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED),
                       lambda rollout: update(rollout, 2, nccl_source(group)))
        assert loop.time() - started < 30
        assert (await c.client.get_transfer(group.group_id)).state == TransferState.ABORTED
        assert await rollout_state(c.client) == State.RUNNING  # released from the transfer


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: an nccl receive is possible")
async def test_nccl_backend_without_cuda_is_a_failed_precondition(server) -> None:
    async with cluster(server) as c:
        group = await c.client.allocate_group(2, TRAINER, [ROLLOUT], timeout_seconds=60, backend="nccl")
        details = await rejected(server, grpc.StatusCode.FAILED_PRECONDITION,
                                 lambda rollout: update(rollout, 2, nccl_source(group)))
        assert "CUDA" in details and "gloo" in details
        outcome = await c.client.get_transfer(group.group_id)
        assert outcome.state == TransferState.ABORTED and "CUDA" in outcome.error


async def test_stale_version_and_bad_requests_are_refused(server) -> None:
    async with cluster(server) as c:
        group = await c.client.allocate_group(1, TRAINER, [ROLLOUT], timeout_seconds=60, backend="gloo")
        source = nccl_source(group)
        details = await rejected(server, grpc.StatusCode.FAILED_PRECONDITION, lambda rollout: update(rollout, 1, source))
        assert "not newer" in details
        assert (await c.client.get_transfer(group.group_id)).state == TransferState.ABORTED  # reported: nobody waits
        group = await c.client.allocate_group(2, TRAINER, [ROLLOUT], timeout_seconds=60, backend="gloo")
        # The group is the one the rollout's own synchronizer knows by that id: it knows no other.
        details = await rejected(server, grpc.StatusCode.NOT_FOUND,
                                 lambda rollout: update(rollout, 2, pb.NcclSource(group_id="elsewhere", rank=1)))
        assert "synchronizer" in details and "'elsewhere' is unknown" in details
        cases = {
            "nccl.rank": pb.NcclSource(group_id=group.group_id, rank=5),
            "nccl.world_size": pb.NcclSource(group_id=group.group_id, rank=1, world_size=7),
        }
        for field, source in cases.items():
            details = await rejected(server, grpc.StatusCode.INVALID_ARGUMENT, lambda rollout, s=source: update(rollout, 2, s))
            assert field in details
        # The disagreement was reported (this replica's member id is known by its rank).
        assert (await c.client.get_transfer(group.group_id)).state == TransferState.ABORTED
        group = await c.client.allocate_group(2, TRAINER, [ROLLOUT], timeout_seconds=60, backend="gloo")
        details = await rejected(server, grpc.StatusCode.INVALID_ARGUMENT,
                                 lambda rollout: update(rollout, 3, nccl_source(group)))
        assert "carries version 2" in details


async def test_caller_giving_up_stops_the_receive_and_reports_it(server) -> None:
    async with cluster(server) as c:
        group = await c.client.allocate_group(2, TRAINER, [ROLLOUT], timeout_seconds=60, backend="gloo")
        async with open_channel(server.address, token=TEST_TOKEN, max_attempts=1) as channel:
            rollout = pb_grpc.RolloutServiceStub(channel)
            request = pb.UpdateWeightsRequest(version=2, nccl=nccl_source(group))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rollout.UpdateWeights(request, timeout=3)  # the controller's own deadline, say
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The transfer is failed at once, not at its 60 s deadline ...
            outcome = await c.client.get_transfer(group.group_id, wait_seconds=10)
            assert outcome.state == TransferState.ABORTED and "cancel" in outcome.error.lower()
            # ... the old weights serve ...
            status = await rollout.GetStatus(pb.GetStatusRequest(), timeout=30)
            assert status.weight_version == server.track.version and not status.updating
        # ... and the rollout is free: the next transfer goes through.
        new = server.track.scaled(0.8)
        group = await c.client.allocate_group(2, TRAINER, [ROLLOUT], timeout_seconds=60, backend="gloo")
        async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
            rollout = pb_grpc.RolloutServiceStub(channel)
            sent, response = await asyncio.gather(
                send_in_group(c.client, TRAINER, group, new, bucket_bytes=BUCKET_BYTES, probe=probe_of(server.track.model, new)),
                update(rollout, 2, nccl_source(group)),
            )
            assert sent.state == TransferState.COMMITTED and response.weight_version == 2
            after = await greedy(rollout)
            assert list(after.completion_token_ids) == reference_greedy(server.track.model, PROMPT, STEPS, new)
    server.track.version, server.track.state = 2, new
