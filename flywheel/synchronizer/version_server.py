"""One held version served over the synchronizer's PullWeights: the pull half of its weight
protocol, for a process other than the synchronizer that holds a verified version (a rollout
serving its site's peers, services.rollout.weights.peers). Readers pull from it with the ordinary
`SynchronizerClient`; its other methods are not served (UNIMPLEMENTED).

It answers in full: a delta base, shared memory and compression are offers the protocol lets a
server decline. It honours `version` (0: what it holds; `at_least`), and resumes from a chunk
under the same stream digest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from flywheel.codec import EncodedVersion
from flywheel.errors import FailedPrecondition, NotFound
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import chunk_frame, manifest_frame

#: The service whose PullWeights is served.
SERVICE = pb.DESCRIPTOR.services_by_name["SynchronizerService"].full_name


def version_pull_handler(held: Callable[[], Awaitable[EncodedVersion]],
                         on_payload: Callable[[int], None] = lambda n: None) -> grpc.GenericRpcHandler:
    """A handler of PullWeights that streams the version `held()` returns (raising NotFound or
    FailedPrecondition when there is none to serve); `on_payload` is told each payload's size."""

    async def pull(request: pb.PullWeightsRequest, context) -> AsyncIterator[bytes]:
        encoded = await held()
        version = encoded.manifest.version
        wanted = request.version
        if wanted and wanted != version and not (request.at_least and wanted < version):
            raise NotFound(f"this source holds version {version}, not {wanted}")
        first = request.resume_from
        if first and bytes(request.resume_digest) != bytes(encoded.manifest.digest):
            raise FailedPrecondition(f"version {version} is now another stream; pull it again from the start")
        yield manifest_frame(encoded.manifest)
        for seq, (header, payload) in enumerate(encoded.pieces()):
            if seq >= first:
                on_payload(len(payload))
                yield chunk_frame(header, payload)

    method = grpc.unary_stream_rpc_method_handler(
        pull, request_deserializer=pb.PullWeightsRequest.FromString, response_serializer=None)
    return grpc.method_handlers_generic_handler(SERVICE, {"PullWeights": method})
