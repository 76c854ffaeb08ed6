"""Prometheus metrics of the rollout service: engine load, tokens, weight updates.

Declared at import time (app.py imports this module) so that every family is
in the first scrape, before the engine has served anything.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

WEIGHT_VERSION = Gauge(
    "flywheel_rollout_weight_version",
    "Weight version the engine generates with (0 for the base model).",
)
STAGING_HELD_BYTES = Gauge(
    "flywheel_rollout_staging_held_bytes",
    "CPU memory kept between MEMORY updates to stage the next version into (updates.reuse_staging).",
)
REQUESTS_RUNNING = Gauge(
    "flywheel_rollout_requests_running",
    "Generation requests the engine is decoding now.",
)
REQUESTS_WAITING = Gauge(
    "flywheel_rollout_requests_waiting",
    "Generation requests queued, waiting for the engine (or for a weight update to finish).",
)
PROMPT_TOKENS = Counter(
    "flywheel_rollout_prompt_tokens_total",
    "Prompt tokens processed.",
)
GENERATED_TOKENS = Counter(
    "flywheel_rollout_generated_tokens_total",
    "Completion tokens generated.",
)
UPDATE_PAUSE = Histogram(
    "flywheel_rollout_update_pause_seconds",
    "Time generation was paused to apply a weight update, in seconds.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
WEIGHT_UPDATES = Counter(
    "flywheel_rollout_weight_updates_total",
    "Weight updates attempted, by outcome (committed or failed).",
    ["outcome"],
)
WEIGHT_UPDATE_BYTES = Counter(
    "flywheel_rollout_weight_update_bytes_total",
    "Bytes of weights staged by committed updates, in bytes.",
)
PEER_SERVED_BYTES = Counter(
    "flywheel_rollout_peer_served_bytes_total",
    "Weight payload bytes this replica served to its site's peers (updates.serve_peers).",
)
REJECTED_REQUESTS = Counter(
    "flywheel_rollout_rejected_requests_total",
    "Generation requests refused before reaching the engine, by reason (queue_full).",
    ["reason"],
)
ADAPTER_LOADS = Counter(
    "flywheel_rollout_adapter_loads_total",
    "LoRA adapters loaded onto the engine (adapters.max_resident): first, the first time this replica served it; "
    "reload, again after it was evicted.",
    ["kind"],
)
ADAPTER_EVICTIONS = Counter(
    "flywheel_rollout_adapter_evictions_total",
    "LoRA adapters unloaded to make room for another (least recently used first).",
)
ADAPTERS_RESIDENT = Gauge(
    "flywheel_rollout_adapters_resident",
    "LoRA adapters loaded on the engine now.",
)
