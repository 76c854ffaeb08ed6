"""Prometheus metrics of the controller: pipeline throughput, staleness, pools,
and the fleet's verdict on the weights it trains on.

Declared at import time (app.py imports this module) so that every family is
in the first scrape, before a run starts. Every label's values are
pre-initialised; none is per request or per replica (a replica's own coverage
is in metrics.jsonl and on the status page).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from flywheel.synchronizer.types import TIMED_PHASES

POOLS = ("trajectory", "train_batch")

SAMPLES = Counter(
    "flywheel_controller_samples_total",
    "Scored trajectories accepted into the trajectory pool.",
)
TRAINED_TOKENS = Counter(
    "flywheel_controller_trained_tokens_total",
    "Tokens in the batches the trainer has finished training on.",
)
STALENESS = Histogram(
    "flywheel_controller_staleness",
    "Weight versions between the trainer and the policy that generated a trajectory, at training time.",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16),
)
POOL_SIZE = Gauge(
    "flywheel_controller_pool_size",
    "Items waiting in a pool: scored trajectories, or train batches ready for the trainer.",
    ["pool"],
)
IN_FLIGHT = Gauge(
    "flywheel_controller_in_flight",
    "Rollout requests sent and not yet answered.",
)
TRAINER_IDLE = Gauge(
    "flywheel_controller_trainer_idle_ratio",
    "Fraction of the last training interval the trainer spent waiting for data (0..1).",
)

for _pool in POOLS:
    POOL_SIZE.labels(_pool)

THROUGHPUT_SAMPLES = Gauge(
    "flywheel_controller_samples_per_second",
    "Trained samples per second since the run started.",
)
THROUGHPUT_TOKENS = Gauge(
    "flywheel_controller_tokens_per_second",
    "Trained tokens (prompt + completion) per second since the run started.",
)
TRAINER_STEP = Gauge(
    "flywheel_controller_trainer_step",
    "Trainer steps done in the current run.",
)
COMPONENT_BUSY = Gauge(
    "flywheel_controller_component_busy_seconds",
    "Seconds each component had work in flight since the run started.",
    ["component"],
)
COMPONENT_IDLE = Gauge(
    "flywheel_controller_component_idle_seconds",
    "Seconds each component had no work in flight since the run started.",
    ["component"],
)
DROPPED_GROUPS = Gauge(
    "flywheel_controller_dropped_groups",
    "Groups the algorithm processor dropped in the current run, by reason.",
    ["reason"],
)
UPDATE_PHASE_SECONDS = Gauge(
    "flywheel_controller_update_phase_seconds",
    "The slowest replica's duration of each phase of the weight updates verified during the last step "
    "(pause: admit to reopen, what generation felt), in seconds.",
    ["phase"],
)
QUARANTINED = Gauge(
    "flywheel_controller_quarantined_replicas",
    "Rollout replicas out of service because their last weight update failed (transfer, apply or verification).",
)
for _phase in TIMED_PHASES:
    UPDATE_PHASE_SECONDS.labels(_phase)

#: The outcomes of a replica's weight update (flywheel.synchronizer.types.UpdateOutcome).
UPDATE_OUTCOMES = ("verified", "failed", "unverified")
WEIGHT_UPDATES = Counter(
    "flywheel_controller_weight_updates_total",
    "Weight updates the rollout replicas reported, by outcome: verified (every tensor measured and equal), failed "
    "(a phase failed) or unverified (not every tensor measured).",
    ["outcome"],
)
for _outcome in UPDATE_OUTCOMES:
    WEIGHT_UPDATES.labels(_outcome)

#: A replica's place in the fleet's verdict on a version (services/controller/weights/verdict.py).
VERDICTS = ("verified", "quarantined", "unverified", "pending")
VERDICT_REPLICAS = Gauge(
    "flywheel_controller_verdict_replicas",
    "Rollout replicas by their verdict on the newest weight version the last trained batch's tokens came from: "
    "verified it (or a newer one), quarantined, serving it unverified (a policy that accepts that), no report yet.",
    ["verdict"],
)
for _verdict in VERDICTS:
    VERDICT_REPLICAS.labels(_verdict)
VERDICT_VERSION = Gauge(
    "flywheel_controller_verdict_weight_version",
    "The weight version of the fleet's last verdict: the newest one the last trained batch's tokens came from.",
)
COVERAGE = Gauge(
    "flywheel_controller_update_coverage_ratio",
    "The smallest share of that version's tensors a replica that reported it measured (resident or as received), "
    "0..1; 1: every replica measured every tensor.",
)
PROBE_DIFF = Gauge(
    "flywheel_controller_probe_max_abs_diff_nats",
    "The largest per-token log-prob difference between a replica's probe of that version and the trainer's, in nats "
    "(0 when no probe ran).",
)
PROBE_HELD = Gauge(
    "flywheel_controller_probe_held_vs_tolerance_ratio",
    "The largest, over the replicas that reported that version, of the difference their probe check held (the "
    "largest per-token one, or the median where the engine's kernels are not the trainer's) divided by its tolerance: at most 1 passed.",
)
VERIFY_WAIT = Counter(
    "flywheel_controller_verify_wait_seconds_total",
    "Seconds train steps waited for a replica's report that it verified the versions their tokens came from.",
)

COMPONENTS = ("trainer", "rollout")
for _component in COMPONENTS:
    COMPONENT_BUSY.labels(_component)
    COMPONENT_IDLE.labels(_component)


def update_from_step(metrics: dict[str, float]) -> None:
    """Sets the families from one step's metrics (names as the pipeline records them)."""
    get = metrics.get
    if "step" in metrics:
        TRAINER_STEP.set(metrics["step"])
    if "throughput/samples_per_second" in metrics:
        THROUGHPUT_SAMPLES.set(metrics["throughput/samples_per_second"])
    if "throughput/tokens_per_second" in metrics:
        THROUGHPUT_TOKENS.set(metrics["throughput/tokens_per_second"])
    if "time/trainer_idle_fraction" in metrics:
        TRAINER_IDLE.set(metrics["time/trainer_idle_fraction"])
    POOL_SIZE.labels("trajectory").set(get("pool/trajectory", 0.0))
    POOL_SIZE.labels("train_batch").set(get("pool/train_batch", 0.0))
    IN_FLIGHT.set(get("rollout/in_flight", 0.0))
    QUARANTINED.set(get("fleet/quarantined", 0.0))
    for phase in TIMED_PHASES:
        if f"update/{phase}_seconds_max" in metrics:
            UPDATE_PHASE_SECONDS.labels(phase).set(metrics[f"update/{phase}_seconds_max"])
    _update_verdict(metrics)
    SAMPLES.inc(get("rollout/new_samples", 0.0))
    TRAINED_TOKENS.inc(get("batch/tokens", 0.0))
    for name, value in metrics.items():
        if name.startswith("time/busy_seconds/"):
            COMPONENT_BUSY.labels(name.rsplit("/", 1)[1]).set(value)
        elif name.startswith("time/idle_seconds/"):
            COMPONENT_IDLE.labels(name.rsplit("/", 1)[1]).set(value)
        elif name.startswith("dropped/"):
            DROPPED_GROUPS.labels(name.split("/", 1)[1]).set(value)


def _update_verdict(metrics: dict[str, float]) -> None:
    """The verdict's families from a step's metrics (weights/verdict.py names them)."""
    for outcome in UPDATE_OUTCOMES:
        WEIGHT_UPDATES.labels(outcome).inc(metrics.get(f"update/{outcome}", 0.0))
    VERIFY_WAIT.inc(metrics.get("verdict/wait_seconds", 0.0))
    if "verdict/version" not in metrics:
        return
    VERDICT_VERSION.set(metrics["verdict/version"])
    for verdict in VERDICTS:
        VERDICT_REPLICAS.labels(verdict).set(metrics.get(f"verdict/{verdict}_replicas", 0.0))
    covered = {k[len("coverage/"):-len("/covered_tensors")]: v for k, v in metrics.items()
               if k.startswith("coverage/") and k.endswith("/covered_tensors")}
    shares = [covered[r] / metrics[f"coverage/{r}/tensors"] if metrics.get(f"coverage/{r}/tensors") else 0.0
              for r in covered]
    COVERAGE.set(min(shares, default=0.0))
    PROBE_DIFF.set(max((v for k, v in metrics.items()
                        if k.startswith("coverage/") and k.endswith("/probe_max_abs_diff")), default=0.0))
    PROBE_HELD.set(max((v for k, v in metrics.items()
                        if k.startswith("coverage/") and k.endswith("/probe_held_vs_tolerance")), default=0.0))


def observe_staleness(values: list[int]) -> None:
    for v in values:
        STALENESS.observe(v)
