"""Builds a Pipeline from a RunConfig and a set of engines.

`Services` is what the pipeline talks to: a trainer, rollout replicas, the
synchronizer (every run has one: it owns the weights' versions) and health
probes: the gRPC adapters (`adapters.connect`) in a real run, the simulated
ones in tests and the benchmark. `build_pipeline` resolves every name in the config (worker type,
reward, algorithm, tools, agent, data files) before anything starts, and a
name that does not resolve is a ConfigError naming its field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.runtime.config import ConfigError
from services.controller.telemetry.activity import ActivityTracker
from services.controller.batches.algorithms import make_algorithm
from services.controller.batches.batching import TokenBound
from services.controller.rollouts.balancer import EnginePool
from services.controller.tasks.loader import DataLoader, loader_from_config
from services.controller.domain import SamplingSpec
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.rollouts.liveness import LivenessMonitor
from services.controller.rollouts.membership import Connect, Membership
from services.controller.weights.observer import SynchronizerObserver
from services.controller.telemetry.metrics_log import JsonlSink, MemorySink, MetricsLog, MetricsSink
from services.controller.pipeline import Pipeline
from services.controller.batches.pool import TrajectoryPool
from services.controller.batches.processor import AlgorithmProcessor, TrainBatchPool
from services.controller.protocols import HealthProbe, RolloutEngine, Synchronizer, Trainer
from services.controller.tasks.judge import Post, RemoteJudge
from services.controller.tasks.teacher import Score, Teacher
from services.controller.workers.environment import EnvironmentWorker, OpenSession
from services.controller.tasks.rewards import get_reward, import_object
from services.controller.rollouts.manager import RolloutManager
from services.controller.run_config import RunConfig, SamplingConfig
from services.controller.batches.staleness import StalenessGate
from services.controller.batches.train_worker import TrainWorker
from services.controller.rollouts.validation import Validator
from services.controller.weights.fleet import Fleet
from services.controller.workers import WorkerContext, worker_class
from services.controller.workers.external import load_agent
from services.controller.workers.verifiers import VerifiersEnvironment, VerifiersWorker
from services.controller.workers.tools import ToolRegistry

TRAINER_PROBE = "trainer"


@dataclass
class Services:
    trainer: Trainer
    #: A fixed set of replicas (simulated runs); a real run has none here and
    #: takes the replicas registered with the synchronizer (`connect_rollout`).
    rollouts: Sequence[RolloutEngine]
    synchronizer: Synchronizer
    #: Health probes; rollout probes are named like their replica, the
    #: trainer's "trainer" (its failure is critical).
    probes: Sequence[HealthProbe] = field(default_factory=list)
    #: Membership from the synchronizer's registry: (id, address) -> engine and probe
    #: of a replica that registers; None: `rollouts` is the fixed set.
    connect_rollout: Connect | None = None
    #: Ids or addresses the registry's replicas are filtered by (empty: all).
    rollout_filter: Sequence[str] = ()
    #: Closes connections when the run ends.
    close: Callable[[], Any] | None = None
    #: How a remote judge's bodies are sent (reward.judge; tasks.judge.Post): None posts them over HTTP to
    #: reward.judge.url (adapters.judge_http); tests and benches pass a simulated judge.
    judge: Post | None = None
    #: How the teacher's Score calls are made (algorithm.teacher; tasks.teacher.Score): over gRPC to its
    #: addresses (adapters.teacher_grpc, made by adapters.connect); tests and benches pass a simulated one.
    teacher: Score | None = None
    #: How a session on the environment server is opened (worker.env; workers.environment.OpenSession):
    #: None opens one over its WebSocket path (adapters.environment_ws); tests pass a simulated environment.
    environment: OpenSession | None = None
    #: The verifiers environment (worker.verifiers; workers.verifiers.VerifiersEnvironment): None starts the
    #: verifiers host (adapters.verifiers_env); tests pass a simulated one.
    verifiers: VerifiersEnvironment | None = None


def _resolve(field_name: str, make: Callable[[], Any]) -> Any:
    try:
        return make()
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{field_name}: {exc}") from None


def sampling_spec(cfg: SamplingConfig) -> SamplingSpec:
    # Processed log-probs (the sampling contract): the trainer replays the distribution that drew each
    # token; a replica set to return raw ones refuses these requests rather than mislead the ratio.
    return SamplingSpec(
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_tokens,
        stop=tuple(cfg.stop), seed=cfg.seed, logprobs_mode="processed",
    )


def build_tools(cfg: RunConfig) -> ToolRegistry:
    tools = ToolRegistry(cfg.worker.tool_timeout_seconds)
    for i, tool in enumerate(cfg.worker.tools):
        fn = _resolve(f"worker.tools[{i}].function", lambda t=tool: import_object(t.function))
        _resolve(f"worker.tools[{i}].function", lambda t=tool, f=fn: tools.register(t.name, f, t.description, t.parameters))
    return tools


def build_pipeline(
    cfg: RunConfig,
    services: Services,
    *,
    run_dir: Path | None = None,
    keep_history: bool = False,
    sinks: Sequence[MetricsSink] = (),
    retry_backoff_seconds: float = 0.5,
) -> Pipeline:
    worker_cls = _resolve("worker.type", lambda: worker_class(cfg.worker.type))
    if cfg.worker.verifiers is not None and not issubclass(worker_cls, VerifiersWorker):
        raise ConfigError(f"worker.verifiers: {cfg.worker.type} is not a verifiers worker (a VerifiersWorker)")
    if cfg.worker.env is not None and not issubclass(worker_cls, EnvironmentWorker):
        raise ConfigError(f"worker.env: {cfg.worker.type} is not an openenv worker (an EnvironmentWorker)")
    tracker, errors = ActivityTracker(), ErrorReporter(cfg.errors.policy, cfg.errors.max_recorded)
    judge, close_judge = None, None
    if cfg.reward.judge is not None:
        post = services.judge
        if post is None:
            from services.controller.adapters.judge_http import HttpJudge

            http = HttpJudge(cfg.reward.judge)
            post, close_judge = http.post, http.close
        judge = RemoteJudge(cfg.reward.judge, post, errors)
    reward = judge or _resolve("reward.name", lambda: get_reward(cfg.reward.name))
    teacher = None
    if cfg.algorithm.teacher is not None:
        if services.teacher is None:
            raise ConfigError("algorithm.teacher: these services have no teacher to call (adapters.connect makes one "
                              "of algorithm.teacher.addresses)")
        teacher = Teacher(cfg.algorithm.teacher, services.teacher, errors)
    algorithm = _resolve("algorithm.name", lambda: make_algorithm(cfg))
    tools = build_tools(cfg) if cfg.worker.tools else None
    agent = _resolve("worker.agent", lambda: load_agent(cfg.worker.agent)) if cfg.worker.agent else None
    loader = _resolve(
        "data.train", lambda: loader_from_config(cfg.data.train, seed=cfg.run.seed, epochs=cfg.data.epochs, split="train")
    )
    val_loader: DataLoader | None = None
    if cfg.data.validation is not None:
        val_loader = _resolve(
            "data.validation", lambda: loader_from_config(cfg.data.validation, seed=cfg.run.seed, epochs=1, split="val")
        )

    openenv, verifiers = _environments(cfg, services)
    engines = EnginePool(services.rollouts, dynamic=services.connect_rollout is not None)
    group, batch = cfg.worker.group_size, cfg.algorithm.train_batch_size
    pool = TrajectoryPool(cfg.pool_store, cfg.pool.keys, group, cfg.buffer_size_limit, cfg.pool.count_in_flight)
    instance = pool.instance(cfg.model.tag)
    gate = StalenessGate(batch, cfg.dispatch_lookahead)
    ctx = WorkerContext(
        engines=engines, reward=reward, reward_kwargs=dict(cfg.reward.kwargs), model_tag=cfg.model.tag,
        chat=cfg.worker.chat, system_prompt=cfg.worker.system_prompt, instruction=cfg.worker.instruction,
        max_turns=cfg.worker.max_turns,
        tools=tools, tool_result_template=cfg.worker.tool_result_template,
        agent=agent, agent_timeout_seconds=cfg.worker.agent_timeout_seconds,
        session_ttl_seconds=cfg.worker.session_ttl_seconds, errors=errors,
        environment=openenv, environment_config=cfg.worker.env, verifiers=verifiers,
    )
    worker = worker_cls(ctx)

    rollouts = RolloutManager(
        worker, loader, instance, gate, tracker, errors,
        group_size=group, sampling=sampling_spec(cfg.worker.sampling), max_in_flight=cfg.worker.max_in_flight,
        max_retries=cfg.worker.max_retries, timeout_seconds=cfg.worker.timeout_seconds,
        retry_backoff_seconds=retry_backoff_seconds, until_a_replica_serves=engines.until_one_serves,
        scoring_slots=_scoring_slots(cfg), teacher=teacher,
    )
    batches = TrainBatchPool(maxsize=1)
    processor = AlgorithmProcessor(
        instance, algorithm, gate, batches,
        batch_size=batch, group_size=group, staleness_limit=cfg.staleness_limit,
        stale_policy=cfg.staleness.policy, in_flight_slack=cfg.pace_slack, drop_last=cfg.data.drop_last,
        token_bound=TokenBound(cfg.token_staleness_bound, correct=cfg.corrects_stale_tokens),
        requeue=rollouts.requeue, finish=rollouts.finish,
    )
    train_worker = TrainWorker(
        services.trainer, batches, tracker, errors,
        loss=cfg.loss, micro_batch_size=cfg.algorithm.micro_batch_size, keep_history=keep_history,
    )
    sync = cfg.sync
    fleet = Fleet(
        services.synchronizer, engines, gate, mode=cfg.mode, method=sync.method, style=sync.style,
        interval=sync.interval, offset=sync.offset, pause_mode=sync.pause_mode, timeout_seconds=sync.timeout_seconds,
        verify_timeout_seconds=cfg.verify_timeout_seconds,
    )
    validator = None
    if val_loader is not None:
        val = cfg.validation
        validator = Validator(
            worker, val_loader, errors, interval=val.interval, n=val.group_size,
            sampling=sampling_spec(val.sampling) if val.sampling else SamplingSpec(temperature=0.0, max_tokens=cfg.worker.sampling.max_tokens),
            max_samples=val.max_samples, concurrency=val.max_in_flight, timeout_seconds=cfg.worker.timeout_seconds,
        )
    liveness = None
    if services.probes or services.connect_rollout is not None:
        def on_change(name: str, ok: bool) -> None:
            if name in engines:  # replicas that joined later included
                engines.mark(name, ok)

        liveness = LivenessMonitor(
            services.probes, errors, interval=cfg.services.health_interval_seconds,
            critical=[TRAINER_PROBE], on_change=on_change,
        )
        monitor = liveness

        def on_pool_change(name: str, serves: bool) -> None:
            # A replica the pool took out of service (a failed call, a quarantine) is back once its
            # health check passes again: the next passing check is news to the monitor.
            if not serves:
                monitor.forget_health(name)

        engines.on_health_change = on_pool_change
    memory = MemorySink()
    metrics = MetricsLog([memory, *sinks])
    run_dir = run_dir or cfg.run.output_dir
    if run_dir is not None and cfg.metrics.jsonl:
        metrics.add(JsonlSink(Path(run_dir) / "metrics.jsonl"))
    if cfg.metrics.tensorboard_dir is not None:
        from services.controller.telemetry.metrics_log import TensorBoardSink

        metrics.add(_resolve("metrics.tensorboard_dir", lambda: TensorBoardSink(cfg.metrics.tensorboard_dir)))
    if cfg.metrics.wandb_project:
        from services.controller.telemetry.metrics_log import WandbSink

        metrics.add(_resolve(
            "metrics.wandb_project",
            lambda: WandbSink(cfg.metrics.wandb_project, cfg.run.name, cfg.model_dump(mode="json", by_alias=True)),
        ))
    observer = SynchronizerObserver(services.synchronizer.events, Path(run_dir) if run_dir else None,
                                    ask_newest=services.synchronizer.latest_version, newest=fleet.newest)
    membership = Membership(engines, liveness, services.connect_rollout, services.rollout_filter)
    observer.listeners.append(membership.update)
    observer.event_listeners.append(fleet.observe)
    return Pipeline(
        config=cfg, trainer=services.trainer, engines=engines, loader=loader, pool=pool, gate=gate,
        rollouts=rollouts, processor=processor, batches=batches, train_worker=train_worker,
        fleet=fleet, tracker=tracker, errors=errors, metrics=metrics, memory=memory,
        validator=validator, liveness=liveness, observer=observer, run_dir=Path(run_dir) if run_dir else None,
        judge=judge, close_judge=close_judge, teacher=teacher,
    )


def _environments(cfg: RunConfig, services: Services) -> tuple[OpenSession | None, VerifiersEnvironment | None]:
    """What an environment worker plays in, a test's simulated one (in `services`) first: the OpenEnv
    server's sessions (worker.env, over its WebSocket path: adapters.environment_ws), and the verifiers
    host (worker.verifiers: adapters.verifiers_env). None for what the run file does not name."""
    openenv: OpenSession | None = None
    verifiers: VerifiersEnvironment | None = None
    if cfg.worker.env is not None:
        from services.controller.adapters.environment_ws import websocket_sessions

        openenv = services.environment or websocket_sessions(cfg.worker.env)
    if cfg.worker.verifiers is not None:
        from services.controller.adapters.verifiers_env import VerifiersHost

        verifiers = services.verifiers or VerifiersHost(cfg.worker.verifiers)
    return openenv, verifiers


def _scoring_slots(cfg: RunConfig) -> int:
    """Rollout slots for groups awaiting a remote judge's or a teacher's scores while others generate (none
    without either)."""
    judge, teacher = cfg.reward.judge, cfg.algorithm.teacher
    slots = teacher.groups_in_flight if teacher is not None else 0
    if judge is not None:
        slots += judge.groups_in_flight if judge.groups_in_flight is not None else \
            max(1, judge.max_concurrency // cfg.worker.group_size)
    return slots
