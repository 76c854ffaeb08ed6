"""Prometheus metrics of the Tinker gateway: calls by route and outcome, how long the
trainer and sampler work on them, and what the gateway holds.

Declared at import time (app.py imports this module) so that every family is in
the first scrape, before the first call.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "flywheel_tinker_requests_total",
    "Tinker API calls answered, by route and HTTP status.",
    ["route", "status"],
)
WORK = Histogram(
    "flywheel_tinker_work_seconds",
    "Wall time of a request's work once its turn came (trainer or sampler calls), in seconds, by kind.",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
FAILURES = Counter(
    "flywheel_tinker_failures_total",
    "Requests whose future answered an error, by kind and category (user: the request; server: anything else).",
    ["kind", "category"],
)
SESSIONS = Gauge("flywheel_tinker_sessions", "Client sessions running (heartbeating, not finished).")
SAMPLER_VERSION = Gauge(
    "flywheel_tinker_sampler_weight_version", "Weight version the gateway's rollout replica serves for sampling."
)
TENANT_REQUESTS = Counter(
    "flywheel_tinker_tenant_requests_total",
    "Tinker API calls admitted, by the tenant whose key made them (the tenants of the tokens file).",
    ["tenant"],
)
TENANT_DISK = Gauge(
    "flywheel_tinker_tenant_disk_bytes",
    "Bytes on disk of a tenant's checkpoints and weights saved for the sampler, as of the last save or removal.",
    ["tenant"],
)
SAMPLER_SAVES_REMOVED = Counter(
    "flywheel_tinker_sampler_saves_removed_total",
    "Weights saved for the sampler removed from disk, by why (unnamed past the last K of a model, expired, deleted).",
    ["reason"],
)
BODIES_REFUSED = Counter(
    "flywheel_tinker_bodies_refused_total",
    "Request bodies refused with 413 before they were read or decompressed whole, by which side was too large.",
    ["side"],
)
TRAINER_TURNS = Counter(
    "flywheel_tinker_trainer_turns_total",
    "Turns of the trainer (one request of one model each), by tenant: they go round the tenants that wait.",
    ["tenant"],
)
