"""Prometheus metrics of the trainer: progress, throughput, step time.

Declared at import time (app.py imports this module) so that every family is
in the first scrape, before the first training step.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STEP = Gauge(
    "flywheel_trainer_step",
    "Optimizer steps taken (the global step).",
)
WEIGHT_VERSION = Gauge(
    "flywheel_trainer_weight_version",
    "Newest weight version the trainer has exported.",
)
TOKENS = Counter(
    "flywheel_trainer_tokens_total",
    "Tokens forward/backward passes were run on (prompt and completion).",
)
STEP_DURATION = Histogram(
    "flywheel_trainer_step_duration_seconds",
    "Wall time of one optimizer step including its forward/backward passes, in seconds.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
COMPUTE_SECONDS = Counter(
    "flywheel_trainer_compute_seconds_total",
    "Time the trainer's compute thread spent on each kind of call (forward_backward, optim_step, select_model), "
    "waiting for it included: what several models' interleaved calls cost against one batch of them all.",
    ["call"],
)
