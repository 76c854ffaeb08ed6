"""Replicas as weight sources for their site's other replicas.

A replica with `updates.serve_peers` answers the pull half of the
synchronizer's weight protocol (`flywheel.synchronizer.version_server`: the
same request and frames, so a peer is pulled from with the ordinary
`SynchronizerClient`) on its own gRPC server, with the version it serves:
its engine's weights read in place (`Engine.host_weights`, no copy), encoded
once per version. It registers with the label `weights_peer`, and a replica
of the same site that joins or lags finds it in the synchronizer's registry:
a running peer whose verified weights (version and identity, as its
heartbeats report them) are the version it needs.

A peer is trusted for nothing: the puller checks every chunk, the version's
digest and its identity against the one the synchronizer recorded before
anything loads, and pulls from the synchronizer instead when a peer cannot
serve (gone, moved on to another version, or its bytes not the version's).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence

import grpc

from flywheel.codec import EncodedVersion, encode_state_dict
from flywheel.errors import FailedPrecondition, NotFound
from flywheel.synchronizer.types import Component, Role, State
from flywheel.synchronizer.version_server import SERVICE, version_pull_handler
from services.rollout import metrics
from services.rollout.weights.transaction import WeightUpdates

#: The registry label of a replica that serves its weights to peers.
PEER_LABEL = "weights_peer"
#: The service a peer answers on (app.py registers it: the rollout reaches synchronizer code only through weights/).
PEER_SERVICE = SERVICE


class PeerWeights:
    """The replica's verified version, for its peers' pulls."""

    def __init__(self, updates: WeightUpdates) -> None:
        self.updates = updates
        self.core = updates.core
        self._encoded: tuple[int, bytes, EncodedVersion] | None = None
        self._encoding = asyncio.Lock()

    def handler(self) -> grpc.GenericRpcHandler:
        return version_pull_handler(self.held, metrics.PEER_SERVED_BYTES.inc)

    async def held(self) -> EncodedVersion:
        """The served version, encoded (checksums and identity computed once per version)."""
        engine, _ = self.core.require_engine()
        version, identity = self.core.status().version, self.updates.identity
        if version < 1 or not identity or self.core.quarantine_reason:
            raise NotFound(f"this replica serves no verified version to peers (version {version})")
        async with self._encoding:
            if self._encoded is not None and self._encoded[:2] == (version, identity):
                return self._encoded[2]
            weights = engine.host_weights()
            if weights is None:
                raise FailedPrecondition(f"the {engine.kind} engine does not hold its weights on the host")
            encoded = await asyncio.to_thread(encode_state_dict, weights, version)
            if bytes(encoded.manifest.identity) != identity:
                raise FailedPrecondition(f"the weights held changed while they were read (version {version}); "
                                         "ask the synchronizer")
            self._encoded = (version, identity, encoded)
            return encoded


def peer_holding(components: Sequence[Component], site: str, version: int, identity: bytes,
                 own_id: str) -> str | None:
    """The address of a running replica of `site` that serves `version` (with `identity`) to peers."""
    if not site or not identity:
        return None
    peers = sorted({c.identity.address for c in components
                   if c.role is Role.ROLLOUT and c.state is State.RUNNING and c.identity.id != own_id
                   and c.identity.labels.get("site") == site and c.identity.labels.get(PEER_LABEL)
                   and c.weight_version == version and c.weight_identity == identity
                   and not c.quarantined and c.identity.address})
    # Replicas that need the same version spread over its holders (the same one each time for one replica).
    return peers[zlib.crc32(own_id.encode()) % len(peers)] if peers else None
