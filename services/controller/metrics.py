"""Prometheus metrics of the controller: pipeline throughput, staleness, pools.

Declared at import time (app.py imports this module) so that every family is
in the first scrape, before a run starts. The `pool` label is pre-initialised
for both of its values.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
