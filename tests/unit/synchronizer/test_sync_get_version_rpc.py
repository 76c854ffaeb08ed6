"""GetVersion and measured reports over gRPC: a real synchronizer (embedded) and its typed client,
each method's version with its tensor digests and probe, a relay answering for its upstream, and
the scope rollouts call it with."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.codec import identify
from flywheel.errors import FailedPrecondition, NotFound
from flywheel.runtime.auth import Scope
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.types import TransferState, UpdateCoverage, UpdateOutcome, UpdateRecord
from services.synchronizer.app import METHOD_SCOPES
from services.synchronizer.embedded import embedded_synchronizer
from services.synchronizer.relay import Relay
from tests.unit.synchronizer.sync_helpers import small_state
from tests.unit.synchronizer.test_sync_core import service
from tests.unit.synchronizer.test_sync_verification import PROBE, checkpoint_dir


async def test_get_version_round_trip_for_each_method(tmp_path: Path) -> None:
    async with embedded_synchronizer(checkpoint_root=str(tmp_path)) as server, \
            SynchronizerClient(server.address) as client:
        await client.register("trainer", "t", address="127.0.0.1:1", capabilities=["nccl"])
        await client.register("rollout", "r", capabilities=["memory", "nccl"])

        await client.push_weights(small_state(1), 1, probe=PROBE)
        path, digests = checkpoint_dir(tmp_path, 2)
        await client.register_checkpoint(2, str(path), "t", tensors=digests, probe=PROBE)
        group = await client.allocate_group(3, "t", ["r"], timeout_seconds=30, backend="gloo")
        await client.report_transfer(group.group_id, "r", True)
        sent = identify(small_state(3))
        assert await client.report_transfer(group.group_id, "t", True, identity=sent, probe=PROBE) == \
            TransferState.COMMITTED

        memory, checkpoint, nccl = [await client.get_version(v) for v in (1, 2, 3)]
        assert (memory.version, memory.identity, memory.probe) == (1, identify(small_state(1)), PROBE)
        assert (checkpoint.identity.tensors, checkpoint.probe) == (digests, PROBE)
        assert (nccl.identity, nccl.probe, nccl.epoch) == (sent, PROBE, 0)
        with pytest.raises(NotFound, match="version 4 has not been committed"):
            await client.get_version(4)

        # A report's coverage comes back as recorded, and ListUpdates keeps it.
        partial = UpdateCoverage(tensors=5, bytes=10, resident_tensors=2, resident_bytes=4)
        record = await client.report_update(UpdateRecord("r", 1, UpdateOutcome.VERIFIED,
                                                         resident_identity=memory.identity.digest, coverage=partial))
        assert record.outcome == UpdateOutcome.UNVERIFIED and record.coverage == partial
        assert [r.coverage for r in await client.list_updates(1)] == [partial]
        with pytest.raises(FailedPrecondition, match="version 9 has not been committed"):
            await client.report_update(UpdateRecord("r", 9, UpdateOutcome.VERIFIED, coverage=partial))

        # A relay holds bytes, not the run's catalog: it answers from its upstream.
        relay_sync, relay_plane, _ = service()
        relay_plane.relay = Relay(server.address, lambda: SynchronizerClient(server.address, timeout=5),
                                  relay_sync.weights, 5)
        try:
            assert await relay_plane.get_version(3) == nccl
            with pytest.raises(NotFound, match="version 4"):
                await relay_plane.get_version(4)
        finally:
            await relay_plane.relay.close()


def test_rollouts_may_ask_what_a_version_is() -> None:
    # Rollouts call the synchronizer with the service token (test_scoped_tokens.py covers the interceptor).
    assert METHOD_SCOPES["GetVersion"] == Scope.SERVICE
