"""Prometheus metrics of the synchronizer: component states, versions, weight transfers.

Declared at import time (app.py imports this module) so that every family is
in the first scrape, before any component registers: dashboards and alerts
then query names that exist from the start. Labelled families are
pre-initialised for every value of their bounded label sets.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from flywheel.synchronizer.types import TIMED_PHASES, Method

# Lower-case names of the proto enums ComponentRole, ComponentState and SyncMethod.
ROLES = ("trainer", "rollout", "controller", "synchronizer")
STATES = ("stopped", "running", "require_sync", "waiting_sync")
METHODS = tuple(m.name.lower() for m in Method)

COMPONENTS = Gauge(
    "flywheel_synchronizer_components",
    "Registered components, by role and state.",
    ["role", "state"],
)
LATEST_VERSION = Gauge(
    "flywheel_synchronizer_latest_version",
    "Newest committed weight version (0 before the first commit).",
)
WEIGHTS_HELD_BYTES = Gauge(
    "flywheel_synchronizer_weights_held_bytes",
    "Bytes of weight versions held in memory (MEMORY method).",
)
WEIGHT_SYNC_DURATION = Histogram(
    "flywheel_weight_sync_duration_seconds",
    "Time from the start of a weight transfer to its commit on every receiver, in seconds.",
    ["method"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
WEIGHT_SYNC_FAILURES = Counter(
    "flywheel_weight_sync_failures_total",
    "Weight transfers aborted (timeout, checksum mismatch, lost peer).",
    ["method"],
)
WEIGHT_PUSH_BYTES = Counter(
    "flywheel_weight_push_bytes_total",
    "Weight bytes received from trainers (MEMORY method).",
)
WEIGHT_PUSH_SHARED_BYTES = Counter(
    "flywheel_weight_push_shared_bytes_total",
    "Weight payload bytes trainers on this host handed over in shared memory instead of in the stream.",
)
WEIGHT_PULL_BYTES = Counter(
    "flywheel_weight_pull_bytes_total",
    "Weight bytes served to rollouts (MEMORY method).",
)
WEIGHT_PULL_SHARED_BYTES = Counter(
    "flywheel_weight_pull_shared_bytes_total",
    "Weight payload bytes offered to readers in shared memory instead of in the stream (MEMORY method).",
)
DELTA_PULLS = Counter(
    "flywheel_synchronizer_delta_pulls_total",
    "Pulls that asked for a delta from a base version, by what was sent: the delta, or the full "
    "version (base not held, other identity, other tensors, or no smaller).",
    ["sent"],
)
for _sent in ("delta", "full"):
    DELTA_PULLS.labels(_sent)

WEIGHT_VERSIONS_HELD = Gauge(
    "flywheel_synchronizer_weight_versions_held",
    "Committed weight versions whose bytes are held in memory (MEMORY method).",
)
WATCHERS = Gauge(
    "flywheel_synchronizer_watchers",
    "Open Watch streams.",
)
LEASE_EXPIRATIONS = Counter(
    "flywheel_synchronizer_lease_expirations_total",
    "Components marked STOPPED because their lease ran out.",
)

UPDATE_PHASE_SECONDS = Histogram(
    "flywheel_update_phase_seconds",
    "Duration of each phase of the rollouts' weight updates, as they report them (pause: admit to reopen), "
    "in seconds.",
    ["phase"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
UPDATES = Counter(
    "flywheel_updates_total",
    "Rollouts' weight updates by the synchronizer's verdict (verified; unverified: not every tensor measured; "
    "or failed in some phase).",
    ["outcome"],
)
QUARANTINED = Gauge(
    "flywheel_synchronizer_quarantined_rollouts",
    "Live rollouts quarantined (no traffic) since a weight update of theirs failed or was not verified.",
)

for _phase in TIMED_PHASES:
    UPDATE_PHASE_SECONDS.labels(_phase)
for _outcome in ("verified", "unverified", "failed"):
    UPDATES.labels(_outcome)

for _role in ROLES:
    for _state in STATES:
        COMPONENTS.labels(_role, _state)
for _method in METHODS:
    WEIGHT_SYNC_DURATION.labels(_method)
    WEIGHT_SYNC_FAILURES.labels(_method)
