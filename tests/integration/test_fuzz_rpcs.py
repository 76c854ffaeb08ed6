"""Every RPC of every service, driven with messages hypothesis builds from the
descriptors the running server reflects: random field values (undefined enum
numbers, NaN, huge and negative integers, NUL bytes and long strings, nested
messages), then the same bytes truncated. Whatever arrives, the answer is a
status a client can act on, never INTERNAL or UNKNOWN, and the server stays
SERVING.

Cases per RPC: FLYWHEEL_FUZZ_CASES (CI runs the default; the full-length run
sets more). Each run draws new cases from a seed it prints; FLYWHEEL_FUZZ_SEED=N
replays one. A hang is a failure: DEADLINE_EXCEEDED is an answer only from
an RPC whose request may ask it to wait or to compute for long (MAY_WAIT);
UNAVAILABLE from none (these services depend on nothing the test leaves out).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from flywheel.launcher.processes import ServiceProcess, start_service
from tests.conftest import MODEL_FLAGS, TEST_TOKEN

CASES = int(os.environ.get("FLYWHEEL_FUZZ_CASES", "12"))
SEED = int(os.environ.get("FLYWHEEL_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
SERVICE_NAMES = {
    "synchronizer": "flywheel.synchronizer.v1.SynchronizerService",
    "trainer": "flywheel.trainer.v1.TrainerService",
    "rollout": "flywheel.rollout.v1.RolloutService",
    "controller": "flywheel.controller.v1.ControllerService",
}
#: Answers a client can act on, from any RPC. RESOURCE_EXHAUSTED: a full queue or a message over the size limit.
ANSWERED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS,
}
#: RPCs whose request may ask them to wait (a version that never comes, a Watch with no events, a
#: Pause that drains) or to compute for longer than CALL_DEADLINE (a random batch, a long generation):
#: the client's own deadline (DEADLINE_EXCEEDED) is an answer from them, and from no other.
MAY_WAIT = {
    "Watch", "PullWeights", "PushWeights",  # synchronizer
    "Generate", "GenerateStream", "UpdateWeights", "Pause",  # rollout
    "ForwardBackward", "TrainStep", "ComputeLogprobs", "SaveCheckpoint", "LoadCheckpoint",  # trainer
    "StreamMetrics",  # controller
}


def accepted(method: str) -> set[grpc.StatusCode]:
    """The statuses `method` may answer a fuzzed request with."""
    return ANSWERED | ({grpc.StatusCode.DEADLINE_EXCEEDED} if method in MAY_WAIT else set())
CALL_DEADLINE = 3.0
#: The deadline of a MAY_WAIT RPC's call: its DEADLINE_EXCEEDED is an answer, so waiting longer tells
#: nothing more (a PullWeights of a version that never comes held the synchronizer's case for 60 s at 3 s).
WAIT_DEADLINE = 1.0
#: RPCs that end or detach the service under test; each is still fuzzed, but with its effect undone after.
UNDO = {"Pause": "Resume"}
#: RPCs that would end the run the service is part of: sent only empty (and truncated) requests.
NOT_RANDOMIZED = {"Stop"}


class _Token(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call of a plain (sync) channel, reflection's included."""

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {TEST_TOKEN}")]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)

    intercept_stream_stream = intercept_stream_unary


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = getattr(details, "wait_for_ready", None), details.compression
        self.metadata = metadata


# -- messages from descriptors --------------------------------------------------------------------------

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Mostly small values (counts, steps, versions), with the edges of the type."""
    edges = [v for v in (low, high, -1, 0, 1, 2**31 - 1) if low <= v <= high]
    return st.one_of(st.integers(max(low, -4), min(high, 64)), st.sampled_from(edges), st.integers(low, high))


_TEXT = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", "..", "../../etc", "/", "/etc/passwd", "a\0b", "x" * 300, "0.0.0.0:1", "127.0.0.1:0",
                     "latest", "global_step_1", "version_1", "r0", "trainer-0", "{}", "run: {max_steps: 1}"]),
)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    kind = field.type
    if kind in _INT_RANGES:
        return _integers(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-3, 40))
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        width = 32 if kind == FieldDescriptor.TYPE_FLOAT else 64
        return st.one_of(st.floats(width=width), st.sampled_from([0.0, -1.0, 1e-9, 1e30, math.inf, math.nan]))
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return _TEXT
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    raise AssertionError(f"no strategy for field type {kind}")


@st.composite
def messages(draw: Callable, descriptor: Descriptor, depth: int = 0) -> Message:
    message = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 3:
                continue
            entry = field.message_type
            if entry.GetOptions().map_entry:
                key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
                for _ in range(draw(st.integers(0, 2))):
                    k = draw(_scalar(key))
                    if value.type == FieldDescriptor.TYPE_MESSAGE:
                        getattr(message, field.name)[k].CopyFrom(draw(messages(value.message_type, depth + 1)))
                    else:
                        getattr(message, field.name)[k] = draw(_scalar(value))
            elif field.is_repeated:
                for _ in range(draw(st.integers(0, 2))):
                    getattr(message, field.name).add().CopyFrom(draw(messages(entry, depth + 1)))
            else:
                getattr(message, field.name).CopyFrom(draw(messages(entry, depth + 1)))
        elif field.is_repeated:
            getattr(message, field.name).extend(draw(st.lists(_scalar(field), max_size=4)))
        else:
            setattr(message, field.name, draw(_scalar(field)))
    return message


# -- the services ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, service_model: Path) -> Iterator[dict[str, ServiceProcess]]:
    """One of each service, for the whole module (trainer and rollout load a model)."""
    root = tmp_path_factory.mktemp("fuzz")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")} | {"FLYWHEEL_AUTH_TOKEN": TEST_TOKEN}
    flags = {
        "synchronizer": ("--checkpoint-root", str(root)),
        "trainer": (*MODEL_FLAGS["trainer"](service_model), "--checkpoint.dir", str(root / "checkpoints")),
        "rollout": (*MODEL_FLAGS["rollout"](service_model), "--updates.checkpoint-root", str(root)),
        # A free port for its status page: its default (8080) may be a launcher's on the other worker.
        "controller": ("--runs-dir", str(root / "runs"), "--status-port", "0"),
    }
    started = {name: start_service(name, root / "logs", args, env) for name, args in flags.items()}
    try:
        for child in started.values():
            child.wait_ready(120)
        yield started
    finally:
        for child in started.values():
            child.stop()


def _call(channel: grpc.Channel, method: MethodDescriptor, data: bytes) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    deadline = WAIT_DEADLINE if method.name in MAY_WAIT else CALL_DEADLINE
    try:
        if method.client_streaming:
            kind = channel.stream_stream if method.server_streaming else channel.stream_unary
            call = kind(path)(iter([data]), timeout=deadline)
        else:
            kind = channel.unary_stream if method.server_streaming else channel.unary_unary
            call = kind(path)(data, timeout=deadline)
        if method.server_streaming:
            for i, _ in enumerate(call):
                if i >= 3:  # a watch never ends by itself
                    call.cancel()
                    break
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED:
            return grpc.StatusCode.OK
        assert exc.code() in accepted(method.name), (
            f"{method.name}: {exc.code().name} ({exc.details()}); replay with FLYWHEEL_FUZZ_SEED={SEED}")
        return exc.code()
    return grpc.StatusCode.OK


def _serving(channel: grpc.Channel) -> bool:
    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return response.status == health_pb2.HealthCheckResponse.SERVING


def _case(channel: grpc.Channel, method: MethodDescriptor, child: ServiceProcess, seen: set[str]
          ) -> Callable[[Message, int], None]:
    """One case for `method`: the request, then its first `cut` bytes (mod its length)."""
    undo = method.containing_service.methods_by_name.get(UNDO.get(method.name, ""))

    def case(request: Message, cut: int) -> None:
        data = request.SerializeToString()
        for sent in (data, data[: cut % (len(data) + 1)]):
            seen.add(_call(channel, method, sent).name)
            if undo is not None:
                _call(channel, undo, b"")
        assert child.process.poll() is None, f"{child.name} died on {method.name}: {request}"

    return case


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(SERVICE_NAMES))
def test_random_requests_to_every_rpc_get_a_status_a_client_can_act_on(
    name: str, services: dict[str, ServiceProcess]
) -> None:
    print(f"fuzzing {name} with FLYWHEEL_FUZZ_SEED={SEED}")
    channel = grpc.intercept_channel(grpc.insecure_channel(services[name].grpc_address), _Token())
    try:
        # The methods and their request types come from the server itself (reflection), not from our stubs.
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        service = pool.FindServiceByName(SERVICE_NAMES[name])
        assert service.methods
        seen: dict[str, set[str]] = {}
        for method in service.methods:
            strategy = messages(method.input_type)
            if method.name in NOT_RANDOMIZED:
                strategy = st.just(message_factory.GetMessageClass(method.input_type)())
            case = _case(channel, method, services[name], seen.setdefault(method.name, set()))
            settings(max_examples=CASES, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))(seed(SEED)(given(strategy, st.integers(0, 10**6))(case)))()
        assert _serving(channel), f"{name} is not SERVING after the fuzzing"
        print(name, {m: sorted(c) for m, c in seen.items()})
    finally:
        channel.close()


def test_a_handler_that_hangs_fails_the_fuzz() -> None:
    """The negative control: a control-plane RPC that never answers is a failure, not an answer."""
    import threading
    from concurrent import futures

    from flywheel.synchronizer.v1 import synchronizer_pb2 as pb

    release = threading.Event()

    def hang(request, context):
        release.wait(30)
        return pb.StatusResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(hang, request_deserializer=pb.StatusRequest.FromString,
                                                  response_serializer=pb.StatusResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAMES["synchronizer"],
                                                                          {"Status": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = pb.DESCRIPTOR.services_by_name["SynchronizerService"].methods_by_name["Status"]
            with pytest.raises(AssertionError, match="Status: DEADLINE_EXCEEDED"):
                _call(channel, method, b"")
    finally:
        release.set()
        server.stop(0)
