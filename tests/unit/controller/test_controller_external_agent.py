"""The external-agent worker against an in-memory rollout session API.

`FakeRollout` answers the session management API the way services/rollout
does (through httpx.MockTransport, so the real `SessionClient` is used), and
records what a test agent "calls the model" with as the replica would: token
ids, log-probs and versions.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from flywheel.errors import Aborted, DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated, Unavailable
from flywheel.runtime.config import ConfigError
from services.controller.adapters.rollout import GrpcRolloutEngine, http_host
from services.controller.adapters.sessions import AgentService, SessionClient
from services.controller.assemble import Services, build_pipeline
from services.controller.rollouts.balancer import EnginePool
from services.controller.domain import RUN_STEP, RolloutStatus, SamplingSpec
from services.controller.rollouts.episodes import SessionLost
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.loop import run
from services.controller.tasks.rewards import get_reward
from services.controller.testing.simulated import SimulatedRolloutEngine, SimulatedTrainer, simulated_services
from services.controller.workers import ExternalAgentWorker, WorkerContext, worker_class
from services.controller.workers.external import load_agent, python_agent
from tests.unit.controller.controller_helpers import config, task

TOKEN = "rollout-token"
PROMPT = [1, 2, 3]


def error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "x", "param": None, "code": status}})


class FakeRollout:
    """One replica's sessions, in memory."""

    def __init__(self, name: str = "r0") -> None:
        self.name = name
        self.url = f"http://{name}.test:8000"
        self.sessions: dict[str, dict[str, Any]] = {}
        self.opened: list[str] = []
        self.deleted: list[str] = []
        self.open_bodies: list[dict] = []
        self.version = 3
        self.lost = False  # GET answers 410: the replica restarted

    # -- the management API (what SessionClient talks to) --------------------
    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return error(401, "bad token")
        path = request.url.path
        if request.method == "POST" and path == "/v1/sessions":
            body = json.loads(request.content)
            sid = f"{self.name}-s{len(self.opened)}"
            self.sessions[sid] = {"key": f"key-{sid}", "calls": [], "reward": None, "state": "open"}
            self.opened.append(sid)
            self.open_bodies.append(body)
            return httpx.Response(200, json={"id": sid, "key": f"key-{sid}", "base_path": f"/sessions/{sid}/v1",
                                             "expires_in": body.get("ttl_seconds", 600.0)})
        sid = path.rsplit("/", 1)[-1]
        if request.method == "DELETE":
            self.deleted.append(sid)
            return httpx.Response(200, json={}) if self.sessions.pop(sid, None) else error(404, "unknown session")
        if self.lost:
            return error(410, f"session {sid} was lost")
        if sid not in self.sessions:
            return error(404, "unknown session")
        s = self.sessions[sid]
        return httpx.Response(200, json={"id": sid, "state": s["state"], "reward": s["reward"], "calls": s["calls"]})

    # -- the agent-facing side, as a call through the session is recorded ------
    def _session(self, base_url: str, key: str) -> dict[str, Any]:
        assert base_url.startswith(self.url) and base_url.endswith("/v1")
        session = self.sessions[base_url.split("/")[-2]]
        assert session["key"] == key, "a session's key is only valid under its own path"
        return session

    def chat(self, base_url: str, key: str, completion: list[int], *, glue: tuple[int, ...] = (), text: str = "",
             finish: str = "stop", restart: bool = False) -> None:
        """A call continuing the conversation (prompt = previous context + glue), or `restart`ing it."""
        calls = self._session(base_url, key)["calls"]
        context = PROMPT if not calls or restart else calls[-1]["prompt_token_ids"] + calls[-1]["completion_token_ids"]
        calls.append({
            "api": "chat.completions", "prompt_token_ids": context + list(glue), "completion_token_ids": completion,
            "logprobs": [-0.5] * len(completion), "version_start": self.version, "version_end": self.version,
            "finish_reason": finish, "replica": self.name, "text": text,
        })

    def finish(self, base_url: str, key: str, reward: float | None) -> None:
        session = self._session(base_url, key)
        session["state"], session["reward"] = "finished", reward


@dataclass
class FakeReplica:
    """A rollout replica as the engine pool sees it, serving `fake`'s sessions."""

    fake: FakeRollout
    transport: httpx.AsyncBaseTransport | None = None
    _client: SessionClient | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.fake.name

    async def sessions(self) -> SessionClient:
        if self._client is None:
            self._client = SessionClient(self.fake.url, token=TOKEN,
                                         transport=self.transport or httpx.MockTransport(self.fake.handle))
        return self._client


def worker(*replicas, agent, timeout: float = 5.0, reward: str = "math") -> ExternalAgentWorker:
    ctx = WorkerContext(
        engines=EnginePool(list(replicas)), reward=get_reward(reward), agent=python_agent(agent),
        agent_timeout_seconds=timeout, errors=ErrorReporter(),
    )
    return ExternalAgentWorker(ctx)


def two_turns(fake: FakeRollout, answer_text: str = "The answer is \\boxed{4}"):
    """An agent that calls a tool once, then answers."""
    async def agent(task, base_url, api_key):
        fake.chat(base_url, api_key, [10, 11], text="<tool_call>...")
        await asyncio.sleep(0)
        fake.chat(base_url, api_key, [12, 13], glue=(20, 21, 22), text=answer_text)
    return agent


async def test_reward_returned_by_the_agent_and_tokens_from_the_records() -> None:
    fake = FakeRollout()
    seen: list[dict] = []

    async def agent(task, base_url, api_key):
        seen.append(task)
        await two_turns(fake)(task, base_url, api_key)
        return 0.75

    w = worker(FakeReplica(fake), agent=agent)
    token = RUN_STEP.set(7)
    try:
        outcome = await w.rollout(task(answer="4"), 2, SamplingSpec())
    finally:
        RUN_STEP.reset(token)
    assert outcome.status == RolloutStatus.SUCCESS
    assert [t.sample_index for t in outcome.trajectories] == [0, 1]
    for t in outcome.trajectories:
        assert t.reward == 0.75 and t.scores == {"reward": 0.75}
        assert t.prompt_ids == PROMPT and t.response_ids == [10, 11, 20, 21, 22, 12, 13]
        assert t.response_mask == [1, 1, 0, 0, 0, 1, 1] and t.response_logprobs == [-0.5, -0.5, 0, 0, 0, -0.5, -0.5]
        assert t.turn_versions == [(3, 3), (3, 3)] and t.version == 3 and t.engine == "r0"
    assert sorted(fake.deleted) == sorted(fake.opened) and len(fake.opened) == 2 and fake.sessions == {}
    assert seen[0] == {"id": "train:0:0", "prompt": "question 0", "answer": "4", "data": {}}
    body = fake.open_bodies[0]
    assert body["metadata"]["run_step"] == "7" and body["metadata"]["task_id"] == "train:0:0"
    assert body["ttl_seconds"] == 5.0 + 60.0  # the agent's limit plus a grace
    assert w.stats["episodes"] == 2


async def test_reward_posted_to_the_session() -> None:
    fake = FakeRollout()

    async def agent(task, base_url, api_key):
        await two_turns(fake, "wrong: 5")(task, base_url, api_key)
        fake.finish(base_url, api_key, 0.25)  # returns None: the posted reward counts

    outcome = await worker(FakeReplica(fake), agent=agent).rollout(task(answer="4"), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.SUCCESS and outcome.trajectories[0].reward == 0.25


async def test_reward_scored_by_the_run_reward_on_the_final_answer() -> None:
    fake = FakeRollout()
    outcome = await worker(FakeReplica(fake), agent=two_turns(fake)).rollout(task(answer="4"), 1, SamplingSpec())
    t = outcome.trajectories[0]
    assert outcome.status == RolloutStatus.SUCCESS and t.reward == 1.0 and t.scores["accuracy"] == 1.0
    assert t.text == "The answer is \\boxed{4}"  # the final turn only, not the tool call before it
    wrong = await worker(FakeReplica(fake), agent=two_turns(fake, "\\boxed{5}")).rollout(task(answer="4"), 1, SamplingSpec())
    assert wrong.trajectories[0].reward == 0.0


async def test_an_agent_that_raises_is_counted_and_not_trained_on() -> None:
    fake = FakeRollout()

    async def agent(task, base_url, api_key):
        fake.chat(base_url, api_key, [10], text="half an episode")
        if base_url.split("/")[-2].endswith("s1"):
            raise KeyError("tool output had no 'result'")
        return 1.0

    w = worker(FakeReplica(fake), agent=agent)
    outcome = await w.rollout(task(), 2, SamplingSpec())
    assert outcome.status == RolloutStatus.FAIL and outcome.trajectories == []  # the clean sample is not trained either
    assert "sample 1: the agent raised KeyError" in outcome.error and "tool output had no" in outcome.traceback
    assert w.stats["agent_errors"] == 1
    assert sorted(fake.deleted) == sorted(fake.opened)


async def test_an_agent_that_returns_no_usable_number_fails() -> None:
    fake = FakeRollout()

    async def agent(task, base_url, api_key):
        fake.chat(base_url, api_key, [10])
        return "1.0"

    w = worker(FakeReplica(fake), agent=agent)
    outcome = await w.rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.FAIL and "returned a str" in outcome.error and w.stats["agent_errors"] == 1

    async def infinite(task, base_url, api_key):
        fake.chat(base_url, api_key, [10])
        return float("inf")

    outcome = await worker(FakeReplica(fake), agent=infinite).rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.FAIL and "reward is inf" in outcome.error


async def test_an_agent_that_never_calls_the_model_is_counted() -> None:
    fake = FakeRollout()

    async def agent(task, base_url, api_key):
        return 1.0

    w = worker(FakeReplica(fake), agent=agent)
    outcome = await w.rollout(task(), 2, SamplingSpec())
    assert outcome.status == RolloutStatus.FAIL and "never called the model" in outcome.error
    assert w.stats["agent_no_calls"] == 2 and outcome.trajectories == []
    assert sorted(fake.deleted) == sorted(fake.opened)


async def test_an_agent_past_its_limit_is_retried_and_recorded() -> None:
    fake = FakeRollout()

    async def agent(task, base_url, api_key):
        fake.chat(base_url, api_key, [10])
        await asyncio.sleep(30)

    w = worker(FakeReplica(fake), agent=agent, timeout=0.05)
    outcome = await w.rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.RE_ROLLOUT and "past its limit of 0.05s" in outcome.error
    assert w.stats["agent_timeouts"] == 1 and fake.deleted == fake.opened
    record = w.ctx.errors.records[-1]
    assert record.module == "external_agent" and record.severity == "warning" and record.context["task"] == "train:0:0"

    async def own_timeout(task, base_url, api_key):
        raise TimeoutError("the agent's own tool timed out")  # the agent's error, not its limit

    w = worker(FakeReplica(fake), agent=own_timeout)
    outcome = await w.rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.FAIL and w.stats["agent_errors"] == 1 and w.stats["agent_timeouts"] == 0


async def test_a_lost_session_is_retried_and_still_deleted() -> None:
    fake = FakeRollout()
    fake.lost = True
    w = worker(FakeReplica(fake), agent=two_turns(fake))
    outcome = await w.rollout(task(), 2, SamplingSpec())
    assert outcome.status == RolloutStatus.RE_ROLLOUT and "lost" in outcome.error
    assert w.stats["sessions_lost"] == 2 and sorted(fake.deleted) == sorted(fake.opened)


async def test_no_replica_or_an_unreachable_one_retries_the_task() -> None:
    fake = FakeRollout()
    replica = FakeReplica(fake)
    w = worker(replica, agent=two_turns(fake))
    w.ctx.engines.mark("r0", False)
    outcome = await w.rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.RE_ROLLOUT and "no healthy rollout replica" in outcome.error

    def refuse(request):
        raise httpx.ConnectError("connection refused")

    down = FakeReplica(FakeRollout("r1"), transport=httpx.MockTransport(refuse))
    w = worker(down, agent=two_turns(fake))
    outcome = await w.rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.RE_ROLLOUT and not w.ctx.engines.replica("r1").healthy


async def test_a_replica_without_sessions_fails_with_a_clear_message() -> None:
    w = worker(SimulatedRolloutEngine(name="sim"), agent=two_turns(FakeRollout()))
    outcome = await w.rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.FAIL and "simulated replica and serves no agent sessions" in outcome.error


async def test_earlier_segments_are_dropped_and_counted() -> None:
    fake = FakeRollout()

    async def agent(task, base_url, api_key):
        fake.chat(base_url, api_key, [10, 11], text="a plan")
        fake.chat(base_url, api_key, [40], glue=(30,), text="\\boxed{4}", restart=True)  # a rewritten history
        return 1.0

    w = worker(FakeReplica(fake), agent=agent)
    outcome = await w.rollout(task(answer="4"), 1, SamplingSpec())
    t = outcome.trajectories[0]
    assert outcome.status == RolloutStatus.SUCCESS and t.prompt_ids == PROMPT + [30] and t.response_ids == [40]
    assert w.stats["dropped_segments"] == 1


async def test_aborted_calls_retry_and_engine_errors_fail() -> None:
    fake = FakeRollout()

    def ending(finish):
        async def agent(task, base_url, api_key):
            fake.chat(base_url, api_key, [10], finish=finish)
            return 1.0
        return agent

    assert (await worker(FakeReplica(fake), agent=ending("abort")).rollout(task(), 1, SamplingSpec())).status == RolloutStatus.RE_ROLLOUT
    assert (await worker(FakeReplica(fake), agent=ending("error")).rollout(task(), 1, SamplingSpec())).status == RolloutStatus.FAIL


async def test_episodes_spread_over_replicas_and_stay_on_theirs() -> None:
    fakes = [FakeRollout("a"), FakeRollout("b")]

    async def agent(task, base_url, api_key):
        fake = next(f for f in fakes if base_url.startswith(f.url))
        fake.chat(base_url, api_key, [10])
        await asyncio.sleep(0.01)
        fake.chat(base_url, api_key, [11], glue=(20,))
        return 1.0

    w = worker(*(FakeReplica(f) for f in fakes), agent=agent)
    outcome = await w.rollout(task(), 2, SamplingSpec())
    assert sorted(t.engine for t in outcome.trajectories) == ["a", "b"]  # least loaded: one each
    assert all(len(f.opened) == 1 for f in fakes)
    assert w.ctx.engines.in_flight() == 0


async def test_an_agent_service_over_http() -> None:
    fake = FakeRollout()
    posted: list[dict] = []

    async def agent_service(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        posted.append(body)
        fake.chat(body["base_url"], body["api_key"], [10], text="\\boxed{1}")
        return httpx.Response(200, json={"reward": None})

    service = AgentService("http://agent.test/episode", transport=httpx.MockTransport(agent_service))
    ctx = WorkerContext(engines=EnginePool([FakeReplica(fake)]), reward=get_reward("math"), agent=service)
    outcome = await ExternalAgentWorker(ctx).rollout(task(answer="1"), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.SUCCESS and outcome.trajectories[0].reward == 1.0  # scored by the run
    assert posted[0]["session_id"] == fake.opened[0] and posted[0]["task"]["answer"] == "1"

    failing = AgentService("http://agent.test/episode", transport=httpx.MockTransport(lambda r: error(500, "boom")))
    ctx = WorkerContext(engines=EnginePool([FakeReplica(fake)]), reward=get_reward("math"), agent=failing)
    outcome = await ExternalAgentWorker(ctx).rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.FAIL and "agent service http://agent.test/episode: HTTP 500: boom" in outcome.error


async def test_agents_load_from_a_file_a_module_or_a_url(tmp_path: Path) -> None:
    path = tmp_path / "my_agent.py"
    path.write_text("import threading\n\ndef run(task, base_url, api_key):\n    return threading.current_thread().name\n")
    agent = load_agent(f"{path}:run")
    assert await agent({}, "u", "k", "s") != threading.current_thread().name  # a sync agent runs in a thread
    assert callable(load_agent("services.controller.tasks.rewards:math_reward"))
    assert isinstance(load_agent("http://127.0.0.1:9/episode"), AgentService)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_agent(f"{path}:nope")
    with pytest.raises(ValueError, match="no file"):
        load_agent(f"{tmp_path / 'missing.py'}:run")


def test_config_asks_for_an_agent_with_the_external_worker() -> None:
    with pytest.raises(ConfigError, match="worker.agent: the external worker needs your agent"):
        config(worker={"type": "external"})
    with pytest.raises(ConfigError, match="worker.agent: only the external worker runs an agent"):
        config(worker={"type": "math", "agent": "pkg.mod:run"})
    with pytest.raises(ConfigError, match="neither 'package.module:function'"):
        config(worker={"type": "external", "agent": "run"})
    with pytest.raises(ConfigError, match=r"agent_timeout_seconds \(600\) must be below worker.timeout_seconds \(600\)"):
        config(worker={"type": "external", "agent": "pkg.mod:run", "agent_timeout_seconds": 600})
    with pytest.raises(ConfigError, match="session_ttl_seconds"):
        config(worker={"type": "external", "agent": "pkg.mod:run", "session_ttl_seconds": 10})
    cfg = config(worker={"type": "external", "agent": "https://agents.example/run", "session_ttl_seconds": 900})
    assert cfg.worker.agent_timeout_seconds == 300.0 and worker_class(cfg.worker.type) is ExternalAgentWorker


def test_the_pipeline_resolves_the_agent_when_it_is_built(tmp_path: Path) -> None:
    services = simulated_services(SimulatedTrainer(), [SimulatedRolloutEngine()])
    with pytest.raises(ConfigError, match="worker.agent: .*no_such_module"):
        build_pipeline(config(worker={"type": "external", "agent": "no_such_module:run"}), services)
    path = tmp_path / "agent.py"
    path.write_text("async def run(task, base_url, api_key):\n    return 1.0\n")
    p = build_pipeline(config(worker={"type": "external", "agent": f"{path}:run", "agent_timeout_seconds": 20}), services)
    worker_ = p.rollouts.worker
    assert isinstance(worker_, ExternalAgentWorker) and worker_.ctx.agent_timeout_seconds == 20
    assert worker_.ttl_seconds == 80 and worker_.ctx.errors is p.errors


async def test_a_run_trains_on_the_session_tokens_and_reports_the_worker_counts() -> None:
    fake = FakeRollout()
    fake.version = 0
    # fully-async: this replica follows no synchronizer (its sessions stay on version 0).
    cfg = config(worker={"type": "external", "agent": "services.controller.tasks.rewards:math_reward", "group_size": 2,
                         "max_in_flight": 2}, algorithm={"train_batch_size": 4}, run={"max_steps": 2}, mode="fully-async")
    p = build_pipeline(cfg, simulated_services(SimulatedTrainer(), [FakeReplica(fake)]), keep_history=True, retry_backoff_seconds=0.01)
    episodes: dict[tuple[str, str], list[dict]] = {}

    async def agent(task, base_url, api_key):
        fake.chat(base_url, api_key, [10, 11])
        fake.chat(base_url, api_key, [12], glue=(20,), text="\\boxed{1}")
        episodes[(task["id"], base_url)] = fake._session(base_url, api_key)["calls"]
        return float(task["answer"] == "1")

    p.rollouts.worker.ctx.agent = python_agent(agent)
    trained = []
    p.hooks.on_record.append(lambda batch, result, metrics: trained.append(batch))
    summary = await run(p)
    assert summary.steps == 2 and len(trained) == 2
    for batch in trained:
        for t in batch.trajectories:
            assert t.prompt_ids + t.response_ids == PROMPT + [10, 11, 20, 12]
            assert t.response_mask == [1, 1, 0, 1] and len(t.turn_versions) == 2
        ids = batch.tensors["input_ids"].tolist()
        assert all(row[:7] == PROMPT + [10, 11, 20, 12] for row in ids)
    metrics = p.memory.latest()
    assert metrics["worker/episodes_total"] >= 8 and len(episodes) >= 8
    # Each session names the run step its calls are for: the replica counts its steps by it.
    assert {b["metadata"]["run_step"] for b in fake.open_bodies} >= {"1", "2"}


async def test_session_client_maps_http_errors() -> None:
    answers = {
        "/v1/sessions/a": error(404, "unknown"), "/v1/sessions/b": error(410, "lost"),
        "/v1/sessions/c": error(503, "busy"), "/v1/sessions/d": error(429, "full"),
        "/v1/sessions/e": error(400, "bad"), "/v1/sessions/f": error(504, "slow"),
    }
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/g"):
            raise httpx.ConnectError("refused")
        if request.url.path.endswith("/h"):
            raise httpx.ReadTimeout("slow")
        return answers[request.url.path]

    client = SessionClient("http://r.test:1/", token="t", transport=httpx.MockTransport(handle))
    expected = {"a": NotFound, "b": SessionLost, "c": Unavailable, "d": ResourceExhausted, "e": InvalidArgument,
                "f": DeadlineExceeded, "g": Unavailable, "h": DeadlineExceeded}
    for sid, exc in expected.items():
        with pytest.raises(exc):
            await client.read(sid)
    assert issubclass(SessionLost, Aborted) and seen[0].headers["authorization"] == "Bearer t"
    try:
        await client.read("b")
    except SessionLost as exc:
        assert "lost" in str(exc) and "records are gone" in str(exc)
    unauth = SessionClient("http://r.test:1", token=None, transport=httpx.MockTransport(FakeRollout().handle))
    with pytest.raises(Unauthenticated):
        await unauth.open()
    await client.close()


async def test_grpc_engine_finds_its_http_url_from_its_status() -> None:
    assert http_host("10.0.0.5:50053") == "10.0.0.5" and http_host("[::1]:50053") == "[::1]"
    assert http_host("dns:///rollout-0.svc:50053") == "rollout-0.svc"
    engine = GrpcRolloutEngine("10.0.0.5:50053", token="t", name="r0")
    ports = [8123, 8123, 9000, 0]

    async def status():
        return SimpleNamespace(http_port=ports.pop(0))

    engine.client.status = status
    try:
        first = await engine.sessions()
        assert first.http_url == "http://10.0.0.5:8123" and await engine.sessions() is first
        moved = await engine.sessions()  # restarted on another port: a new client
        assert moved is not first and moved.http_url == "http://10.0.0.5:9000"
        with pytest.raises(Exception, match="reports no HTTP port"):
            await engine.http_url()
    finally:
        await engine.close()


def test_the_example_agent_and_its_run_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from services.controller.launcher.prepare import prepare_data
    from services.controller.launcher.spec import split_run_file
    from services.controller.run_config import parse_run_config
    from services.controller.workers.external import _function_in_file

    root = Path(__file__).resolve().parents[3]
    spec, data = split_run_file(yaml.safe_load((root / "examples/agent/agent.yaml").read_text()), "agent.yaml")
    data["data"] = prepare_data(spec.dataset, data["data"], tmp_path)
    data["services"] = {"synchronizer": {"address": "127.0.0.1:1"}}  # the launcher fills the addresses in
    cfg = parse_run_config(data)
    assert cfg.worker.type == "external" and spec.dataset.terms == [3]
    monkeypatch.chdir(root)  # the run file names the agent relative to the repository root
    assert callable(load_agent(cfg.worker.agent))
    example = _function_in_file(root / "examples/agent/calculator_agent.py", "calculator").__globals__
    assert example["calculator"]('{"expression": "7 * 3 + 12"}') == "33"
    assert example["calculator"]('{"expression": "__import__(\'os\')"}').startswith("error:")
    assert example["reward"]("So the result is 33.", "33") == 1.0 and example["reward"]("333", "33") == 0.0
