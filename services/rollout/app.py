"""Assembles the rollout service for the server bootstrap.

Startup loads the tokenizer and the engine (health says SERVING only after),
then starts the OpenAI-compatible HTTP API and reports its port: in GetStatus,
in the log, and in `<ready_file stem>.http.json` ({"http_port": N}) next to
the runtime's ready file, for launchers. engine.model_path must name a
model directory: without one the service does not start (the error names the
setting).

With `synchronizer.address` set, the loaded rollout registers with the
synchronizer, heartbeats, reports every weight update and moves its weights
as the synchronizer's policy directs (`services.rollout.weights.link`); SERVING waits
for the first registration (at most `synchronizer.rpc_timeout_seconds`, then
it retries in the background) and for the catch-up to the newest committed
version, and graceful shutdown deregisters it first.
"""

from __future__ import annotations

import gc
import logging

import services.rollout.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.errors import InvalidArgument
from flywheel.models.check import require_model_dir
from flywheel.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from flywheel.runtime.auth import Scope, accepted_tokens, own_token
from flywheel.runtime.server import ServiceSpec
from services.rollout.config import RolloutConfig
from services.rollout.serving.core import RolloutCore
from services.rollout.servicer import RolloutServicer
from services.rollout.weights.arrival import WeightArrival
from services.rollout.weights.peers import PEER_SERVICE, PeerWeights
from services.rollout.weights.transaction import WeightUpdates

log = logging.getLogger(__name__)

PROTO_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
#: Agents may generate, score and tokenize; pausing, status and weight updates are the services'.
#: The HTTP API's routes are all the agent's (services.rollout.openai_api.http_api).
METHOD_SCOPES = {
    "Generate": Scope.AGENT, "GenerateStream": Scope.AGENT, "Tokenize": Scope.AGENT, "Detokenize": Scope.AGENT,
    "Score": Scope.AGENT,
    "GetStatus": Scope.SERVICE, "Pause": Scope.SERVICE, "Resume": Scope.SERVICE, "UpdateWeights": Scope.SERVICE,
}


def build(config: RolloutConfig) -> ServiceSpec:
    model_path = require_model_dir(config.engine.model_path, "rollout", ("engine", "model_path"))
    name = config.engine.served_model_name or model_path.name
    core = RolloutCore(config, engine=None, codec=None, model_name=name)
    updates = WeightUpdates(core, config)
    arrival = WeightArrival(updates, config, own_token(config.server))
    state: dict = {"http": None, "engine": None, "link": None, "grpc_port": 0}

    def http_port() -> int:
        return state["http"].port if state["http"] is not None else 0

    servicer = RolloutServicer(config, core, arrival, http_port)
    peers = PeerWeights(updates) if config.updates.serve_peers else None

    def register(server) -> None:
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
        if peers is not None:
            server.add_generic_rpc_handlers((peers.handler(),))

    async def startup() -> None:
        from services.rollout.engine import create_engine
        from services.rollout.openai_api.http_api import create_app
        from flywheel.runtime.http_server import HttpServer, report_http_port
        from services.rollout.engine.text import TextCodec

        codec = TextCodec.load(config.engine.args.get("tokenizer") or model_path)
        engine = create_engine(config, codec)
        state["engine"] = engine
        await engine.start()
        # torch/vLLM leave millions of long-lived objects: a full collection
        # over them stalls the event loop for seconds (mid-request, and again
        # at exit), so they are moved out of the collector's sight once.
        gc.collect()
        gc.freeze()
        core.attach(engine, codec)
        if config.updates.serve_peers and (engine.host_weights() is None or not config.synchronizer.site):
            raise InvalidArgument(  # refused, not ignored: its peers would find a source that cannot serve
                f"updates.serve_peers needs synchronizer.site (peers are found by site) and an engine that holds "
                f"its weights on the host (the {engine.kind} engine does not, or the site is empty)")
        if config.updates.delta_pulls == "on" and engine.host_weights() is None:
            raise InvalidArgument(  # refused, not ignored: every update would quietly move the full version
                f"updates.delta_pulls is on, but the {engine.kind} engine does not hold its weights on the host "
                "under the checkpoint's names (vLLM pulls in its worker; a GPU model is on the device): use auto or off")
        log.info("engine started", extra={"engine": engine.kind, "model": name, "max_model_len": engine.max_model_len,
                                          "weight_version": engine.version})
        server = config.server
        from services.rollout.weights.link import default_component_id
        from services.rollout.openai_api.sessions import SessionStore

        sessions = SessionStore(default_ttl_seconds=config.sessions.ttl_seconds, max_open=config.sessions.max_open)
        replica = config.synchronizer.component_id or default_component_id(config, state["grpc_port"])
        http = HttpServer(create_app(core, config, accepted_tokens(server), sessions, replica), server.host, config.http_port)
        await http.start()
        state["http"] = http
        report_http_port(server.ready_file, http.port)
        if config.synchronizer.address:
            from services.rollout.weights.link import SynchronizerLink

            state["link"] = SynchronizerLink(config, arrival, state["grpc_port"])
            state["link"].start()
            await state["link"].ready(config.synchronizer.rpc_timeout_seconds)

    async def shutdown() -> None:
        if state["link"] is not None:
            await state["link"].stop()
        if state["http"] is not None:
            await state["http"].stop()
        if state["engine"] is not None:
            await state["engine"].stop()

    return ServiceSpec(
        name="rollout",
        proto_services=[PROTO_SERVICE, *([PEER_SERVICE] if peers is not None else [])],
        register=register,
        method_scopes={**METHOD_SCOPES, **({"PullWeights": Scope.SERVICE} if peers is not None else {})},
        on_bound=lambda port: state.__setitem__("grpc_port", port),
        startup=startup,
        shutdown=shutdown,
    )
