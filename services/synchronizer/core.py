"""The synchronizer's domain service: components, policy, and the rules that
tie them to versions and transfers.

`Synchronizer` owns the registry, the version catalog, the weight store, the
transfer groups, the event bus and the persistent store, and is the only
place where they meet: every state change is persisted, published on Watch
and counted in metrics through `_changed`. The weight plane (pushes, pulls,
checkpoints, groups) is `services.synchronizer.plane.WeightPlane`, built on
top of this object. No grpc here; the servicer translates.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, replace

from flywheel.errors import FailedPrecondition, InvalidArgument, NotFound
from services.synchronizer import metrics
from services.synchronizer.buffers import WeightStore
from services.synchronizer.config import SynchronizerConfig
from services.synchronizer.events import EventBus
from services.synchronizer.groups import Group, Transfers
from flywheel.synchronizer.policy import Decision, decide, validate
from services.synchronizer.registry import Registry
from services.synchronizer.storage import open_pool
from services.synchronizer.store import Store
from services.synchronizer.updates import UpdateLedger, judge, judge_base, judge_dropped
from flywheel.synchronizer.types import (
    Component,
    EventKind,
    Identity,
    Method,
    Policy,
    Role,
    RolloutWait,
    State,
    Style,
    TransferState,
    UpdateOutcome,
    UpdateRecord,
)
from services.synchronizer.versions import VersionCatalog, VersionRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncAnswer:
    """NeedSync's answer: the decision plus what the caller needs to act on it."""

    decision: Decision
    component: Component
    method: Method
    latest_version: int
    group: Group | None
    push_requested: bool
    #: DYNAMIC rollouts waiting: when the request lapses, ms since the epoch (0: none).
    request_deadline_unix_ms: int
    policy: Policy


@dataclass(frozen=True)
class Rewound:
    """What a rewind did."""

    epoch: int
    latest_version: int
    #: The committed versions dropped, oldest first.
    dropped: list[int]
    #: Rollouts serving a version above the rewound one: they go back to it.
    rewinding: list[str]


def policy_from_config(config: SynchronizerConfig) -> Policy:
    p = config.policy
    return Policy(Style[p.style.upper()], Method[p.method.upper()], p.interval, p.offset, p.timeout_seconds)


class Synchronizer:
    def __init__(self, config: SynchronizerConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.store = Store(config.store_path)
        self.events = EventBus(config.watch_queue_size)
        self.registry = Registry(config.lease_seconds, self._changed, clock)
        self.catalog = VersionCatalog()
        # Every held version and push in progress may own a segment.
        pool = open_pool(config.shared_memory_dir, config.keep_versions + config.max_concurrent_pushes)
        self.weights = WeightStore(config.keep_versions, config.max_concurrent_pushes, pool)
        self.transfers = Transfers(
            host=config.rendezvous_host,
            ports=range(config.rendezvous_port_min, config.rendezvous_port_max + 1),
            default_timeout=config.transfer_timeout_seconds,
            default_backend=config.group_backend,
            on_finish=self._transfer_finished,
            clock=clock,
        )
        self.policy = validate(self.store.load_policy() or policy_from_config(config))
        #: Every replica's result of every update of the last versions (memory only).
        self.updates = UpdateLedger(config.keep_update_results)
        #: The least version asked for outside the schedule (RequestVersion) and not committed yet; 0: none.
        self.wanted_version = 0
        self._restore()

    # -- bookkeeping ---------------------------------------------------------

    def _restore(self) -> None:
        components = self.store.load_components()
        now = self._clock()
        for c in components:
            # Transfers do not survive a restart: whoever was in one goes back
            # to asking for it (rollouts) or running (trainers).
            if c.state == State.WAITING_SYNC:
                c.state = State.REQUIRE_SYNC if c.role == Role.ROLLOUT else State.RUNNING
            if c.state == State.REQUIRE_SYNC:
                c.requested_at, c.request_step = now, c.step
        self.registry.restore(components)
        self.catalog.restore(self.store.load_versions())
        self.events.latest_version = self.catalog.latest
        self.events.epoch, self.events.rewound_to, dropped = self.store.load_lineage()
        # Those committed again since the rewind are in the catalog as the new lineage's.
        self.catalog.dropped = dropped - set(self.catalog.records)
        if self.epoch:  # rollouts that had not come back from the last rewind still may
            self.registry.rewinding = {c.id: self.rewound_to for c in components
                                       if c.role == Role.ROLLOUT and c.weight_version > self.rewound_to}
        if components or self.catalog.records:
            log.info(
                "restored state",
                extra={"components": len(components), "latest_version": self.catalog.latest,
                       "push_requested": self.push_requested},
            )
        self._refresh_metrics()

    def _changed(self, c: Component, kind: EventKind, message: str) -> None:
        self.store.save_component(c)
        version = c.awaited_version if kind == EventKind.SYNC_REQUESTED else 0
        self.events.publish(kind, c, message=message, version=version)
        if kind == EventKind.COMPONENT_EXPIRED:
            metrics.LEASE_EXPIRATIONS.inc()
        self._refresh_components()

    def _refresh_components(self) -> None:
        counts = Counter((c.role, c.state) for c in self.registry.components.values())
        for role in Role:
            for state in State:
                metrics.COMPONENTS.labels(role.name.lower(), state.name.lower()).set(counts[(role, state)])
        # Also after a registration: a quarantine outlives it, and a restart.
        metrics.QUARANTINED.set(sum(r.quarantined for r in self.registry.live(Role.ROLLOUT)))

    def _refresh_metrics(self) -> None:
        self._refresh_components()
        metrics.LATEST_VERSION.set(self.catalog.latest)
        metrics.WEIGHTS_HELD_BYTES.set(self.weights.held_bytes)
        metrics.WEIGHT_VERSIONS_HELD.set(len(self.weights.committed))
        metrics.WATCHERS.set(self.events.subscriber_count)

    def commit_version(self, record: VersionRecord, *, location: str = "") -> None:
        """Records a committed version (any method) in this lineage and announces it."""
        record.epoch = self.epoch
        self.catalog.commit(record)
        self.store.save_version(record)
        self.store.trim_versions(min(self.catalog.records))
        self.events.latest_version = self.catalog.latest
        if record.version >= self.wanted_version:
            self.wanted_version = 0
        self.events.publish(
            EventKind.VERSION_COMMITTED, version=record.version, method=record.method, location=location or record.path,
            identity=record.identity,
        )
        self._refresh_metrics()

    def identity_of(self, version: int) -> bytes:
        """The identity `version` was committed with in this lineage (b"": unknown or none)."""
        record = self.catalog.records.get(version) if version else None
        return record.identity if record is not None else b""

    def version_record(self, version: int) -> VersionRecord:
        """What `version` was committed with in this lineage (GetVersion): its identity, tensor digests
        and probe. NotFound, saying why, for a version not committed in it (or whose record is evicted)."""
        if version < 1:
            raise InvalidArgument(f"version must be >= 1, got {version} (version 0 is the base model, which no "
                                  "publisher recorded)")
        record = self.catalog.records.get(version)
        if record is None:
            raise NotFound(self.catalog.why_missing(version, self.epoch, self.rewound_to))
        return record

    @property
    def push_requested(self) -> bool:
        """The newest version is a MEMORY version whose bytes are not held (lost in a restart)."""
        record = self.catalog.latest_record()
        return (
            record is not None
            and record.method == Method.MEMORY
            and record.version not in self.weights.committed
        )

    # -- components ----------------------------------------------------------

    def register(self, identity: Identity, step: int, weight_version: int, weight_identity: bytes = b"") -> Component:
        old = self.registry.components.get(identity.id)
        if old is not None and old.state != State.STOPPED:
            # A component registering again restarted: it left whatever it was in.
            self.transfers.member_left(identity.id, "registered again (restarted)")
        c = self.registry.register(identity, step, weight_version, weight_identity)
        expected = self.identity_of(weight_version)
        if c.role == Role.ROLLOUT and weight_identity and expected and weight_identity != expected:
            # The same number, other bytes: a lineage a rewind abandoned. Never current:
            # no traffic until it installs and verifies the run's version.
            self._quarantine(c, f"holds version {weight_version} with identity {weight_identity.hex()[:16]}, not the "
                                f"run's {expected.hex()[:16]} (weights of a lineage a rewind abandoned)")
        newest = self.catalog.latest_record()
        if c.role == Role.ROLLOUT and newest is not None and newest.method == Method.NCCL and weight_version < newest.version:
            # NCCL versions are kept nowhere to pull from: the replica awaits the
            # newest one, and the trainer broadcasts it again to those behind.
            c.requested_at, c.request_step, c.awaited_version = self._clock(), step, newest.version
            self.registry.move(c, State.REQUIRE_SYNC, EventKind.SYNC_REQUESTED,
                               message=f"joined on version {weight_version}, behind NCCL version {newest.version}")
        if c.role == Role.TRAINER and self.push_requested:
            self.events.publish(
                EventKind.PUSH_REQUESTED, c, version=self.catalog.latest,
                message=f"the bytes of version {self.catalog.latest} were lost; push the current weights",
            )
        return c

    def heartbeat(self, component_id: str, step: int, weight_version: int) -> Component:
        return self.registry.heartbeat(component_id, step, weight_version)

    def deregister(self, component_id: str) -> Component:
        c = self.registry.deregister(component_id)
        self.transfers.member_left(component_id, "deregistered")
        return c

    def set_state(
        self, component_id: str, state: State, *, expected: State | None = None, weight_version: int = 0,
        reason: str = "", weight_identity: bytes = b"",
    ) -> Component:
        c = self.registry.get(component_id)
        self.registry.check(c, state, expected)
        previous, version_changed = c.state, bool(weight_version) and weight_version != c.weight_version
        if weight_version:
            self.registry.went_back(c, weight_version)
            c.weight_version = weight_version
            if weight_identity:
                c.weight_identity = weight_identity
        if c.awaited_version and c.weight_version >= c.awaited_version:
            # Its last request is satisfied (even if it lapsed while the pull ran).
            c.last_sync_step = max(c.last_sync_step, c.request_step)
        if previous in (State.REQUIRE_SYNC, State.WAITING_SYNC) and state == State.RUNNING:
            if self.transfers.pending_for(c.id) is not None:
                self.transfers.member_left(c.id, f"went back to RUNNING at version {c.weight_version}")
        if state == State.STOPPED:
            self.transfers.member_left(c.id, "stopped")
        if state != c.state:
            self.registry.move(c, state, message=reason)
        elif version_changed or reason:
            # A reason alone is news too: a rollout whose update failed still
            # serves the same version in the same state, and watchers must see why.
            self.registry.touch(c, reason or "weight version changed")
        return c

    # -- policy --------------------------------------------------------------

    def configure_policy(
        self,
        *,
        style: Style | None = None,
        method: Method | None = None,
        interval: int = 0,
        offset: int = 0,
        timeout_seconds: float = 0.0,
        rollout_wait: RolloutWait | None = None,
        max_staleness: int = 0,
        pause_mode: str | None = None,
    ) -> Policy:
        """Updates the policy; unset (None/0) fields keep their value, except
        offset, and max_staleness, which comes with rollout_wait."""
        current = self.policy
        policy = Policy(
            style=style or current.style,
            method=method or current.method,
            interval=interval or current.interval,
            offset=offset,
            timeout_seconds=timeout_seconds or current.timeout_seconds,
            rollout_wait=rollout_wait or current.rollout_wait,
            max_staleness=max_staleness if rollout_wait else current.max_staleness,
            pause_mode=pause_mode or current.pause_mode,
        )
        self.policy = validate(policy)
        self.store.save_policy(self.policy)
        log.info("policy configured", extra={"policy": repr(self.policy)})
        return self.policy

    def need_sync(self, component_id: str, step: int) -> SyncAnswer:
        c = self.registry.get(component_id)
        if c.state != State.STOPPED:
            self.registry.renew(c)  # asking is a sign of life
        c.step = step
        latest = self.catalog.latest
        decision = decide(self.policy, c, step, latest, self.registry.live(Role.ROLLOUT), self.push_requested,
                          self.wanted_version)
        if decision.new_request:
            c.requested_at, c.request_step, c.awaited_version = self._clock(), step, decision.version
            self.registry.move(c, decision.state, EventKind.SYNC_REQUESTED)
        elif decision.state != c.state:
            self.registry.move(c, decision.state)
        deadline = 0
        if self.policy.style == Style.DYNAMIC_BY_EXPLORER and c.role == Role.ROLLOUT and c.requested_at is not None:
            deadline = int((time.time() + c.requested_at + self.policy.timeout_seconds - self._clock()) * 1000)
        return SyncAnswer(
            decision=decision, component=replace(c), method=self.policy.method, latest_version=latest,
            group=self.transfers.pending_for(c.id), push_requested=self.push_requested and c.role == Role.TRAINER,
            request_deadline_unix_ms=deadline, policy=self.policy,
        )

    # -- lineage -------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Rewinds so far: the lineage of the versions held now."""
        return self.events.epoch

    @property
    def rewound_to(self) -> int:
        """The version the last rewind went back to (0: none yet)."""
        return self.events.rewound_to

    def rewind(self, to_version: int, reason: str = "", *, start_over: bool = False) -> Rewound:
        """Goes back to `to_version`: the trainer lost the weights after it and resumed from its
        checkpoint. Every version above it is dropped (catalog, store, bytes, pushes and NCCL
        transfers in progress) and a new lineage starts (the epoch goes up): the trainer
        publishes `to_version` + 1 and on again. Rollouts serving a version above it are sent
        back (the REWOUND event; their first report at or below it is taken). Versions only go
        up within a lineage; this is the one way down. `start_over` goes back to version 0, the
        base model (the trainer restarted with no checkpoint): every version is dropped, and the
        replicas reload the weights they started with."""
        if start_over and to_version != 0:
            raise InvalidArgument(f"start_over goes back to version 0 (the base model); to_version must be 0, "
                                  f"got {to_version}")
        if not start_over and to_version < 1:
            raise InvalidArgument(
                f"to_version must be >= 1 (the step of the checkpoint the trainer resumed from), got {to_version}; "
                "to go back to the base model (a trainer with no checkpoint), set start_over")
        ahead = [c for c in self.registry.live(Role.TRAINER) if c.weight_version > to_version]
        if ahead:
            raise FailedPrecondition(
                f"trainer {ahead[0].id!r} holds version {ahead[0].weight_version}, newer than {to_version}: it would "
                "publish the weights a rewind drops; resume it from the checkpoint first")
        rollouts = [c.id for c in self.registry.live(Role.ROLLOUT) if c.weight_version > to_version]
        pending = [g for g in self.transfers.pending() if g.version > to_version]
        staging = [v for v in self.weights.staging if v > to_version]
        if self.catalog.latest <= to_version and not (rollouts or pending or staging):
            raise FailedPrecondition(
                f"nothing to rewind: the newest committed version is {self.catalog.latest} and no rollout serves "
                f"or receives a version above {to_version}")
        dropped = self.catalog.drop_above(to_version)
        self.store.drop_versions_above(to_version)
        self.weights.drop_above(to_version)
        self.updates.drop_above(to_version)
        if self.wanted_version > to_version:
            self.wanted_version = 0  # asked for weights that are gone; whoever needs more asks again
        for group in pending:
            self.transfers.member_left(group.trainer_id, f"the weights were rewound to version {to_version}")
        epoch = self.epoch + 1
        self.events.epoch, self.events.rewound_to = epoch, to_version
        self.events.latest_version = self.catalog.latest
        self.store.save_lineage(epoch, to_version, self.catalog.dropped)
        for c in self.registry.components.values():
            # The steps after to_version are redone: DYNAMIC counts from there again.
            c.last_sync_step = min(c.last_sync_step, to_version)
            c.step = min(c.step, to_version)
            if c.id in rollouts:
                self.registry.rewinding[c.id] = to_version
            if c.state in (State.REQUIRE_SYNC, State.WAITING_SYNC) and c.awaited_version > to_version:
                c.awaited_version = 0
                self.registry.move(c, State.RUNNING, message=f"its sync request went with the rewind to {to_version}")
        why = reason or ("the trainer started over from the base model" if start_over
                         else "the trainer resumed from its checkpoint")
        log.warning("rewound", extra={"to_version": to_version, "epoch": epoch, "dropped": dropped,
                                      "rewinding": rollouts, "reason": why})
        self.events.publish(EventKind.REWOUND, version=to_version, message=why)
        self._publish_rewound_again(to_version, rollouts)
        self._refresh_metrics()
        return Rewound(epoch, self.catalog.latest, dropped, rollouts)

    # -- versions asked for, and fleet updates --------------------------------

    def request_version(self, min_version: int, reason: str = "") -> int:
        """A version >= `min_version` is needed outside the schedule (a run's start or resume, a
        validation): the trainer publishes its weights once its step reaches it (NeedSync says so,
        and VERSION_REQUESTED wakes it between steps). Returns the newest committed version."""
        if min_version < 1:
            raise InvalidArgument(f"min_version must be >= 1 (version 0 is the base model), got {min_version}")
        latest = self.catalog.latest
        if latest >= min_version:
            return latest
        self.wanted_version = max(self.wanted_version, min_version)
        log.info("version requested", extra={"min_version": min_version, "latest": latest, "reason": reason})
        self.events.publish(EventKind.VERSION_REQUESTED, version=min_version, message=reason)
        return latest

    def _quarantine(self, c: Component, reason: str) -> None:
        c.quarantined, c.quarantine_reason = True, reason
        log.warning("rollout quarantined", extra={"id": c.id, "reason": reason})
        self.registry.touch(c, f"quarantined: {reason}")

    def report_update(self, report: UpdateRecord) -> UpdateRecord:
        """Records a rollout's update result with the synchronizer's verdict (`updates.judge`): a failed
        or unverified update quarantines the rollout, only a verified one ends its quarantine. A claim
        of success (VERIFIED or UNVERIFIED) for a version never recorded in this lineage is refused
        (FAILED_PRECONDITION): there is nothing to judge it against. A failure is recorded whatever
        the version: the replica's weights may be broken either way. Version 0 (the base model) is an
        update only after the run started over (a rewind to 0); see `updates.judge_base`."""
        if report.version == 0 and not (self.epoch and self.rewound_to == 0):
            raise InvalidArgument("version: must be >= 1, got 0 (the base model is reported only after a rewind "
                                  "to version 0)")
        c = self.registry.get(report.component_id)
        if c.role != Role.ROLLOUT:
            raise InvalidArgument(f"ReportUpdate is for rollouts; {c.id!r} is a {c.role.name.lower()}")
        base = report.version == 0
        if report.version in self.catalog.dropped:
            # A replica that finished installing a version after a rewind dropped it: it holds a lost lineage's weights.
            record = judge_dropped(report, self.rewound_to, self.epoch)
        elif base:
            record = judge_base(report, self.epoch)
        else:
            version = self.catalog.records.get(report.version)
            if version is None and report.outcome != UpdateOutcome.FAILED:
                raise FailedPrecondition(
                    f"{c.id!r} reports version {report.version} {report.outcome.name}, but "
                    f"{self.catalog.why_missing(report.version, self.epoch, self.rewound_to)}: a claim is judged "
                    "only against a version this synchronizer recorded")
            record = judge(report, version, self.epoch)
        self.updates.record(record)
        for phase, seconds in record.timings.by_phase().items():
            if seconds:
                metrics.UPDATE_PHASE_SECONDS.labels(phase).observe(seconds)
        metrics.UPDATES.labels(record.outcome.name.lower()).inc()
        if record.resident_identity:
            c.weight_identity = record.resident_identity
        if record.verified:
            if c.quarantined:
                log.info("rollout rejoins: its update verified", extra={"id": c.id, "version": record.version})
            c.quarantined, c.quarantine_reason = False, ""
            self.store.save_component(c)
            self._refresh_components()
        elif record.outcome == UpdateOutcome.FAILED:
            phase = record.failed_phase.name.lower() if record.failed_phase else "update"
            self.store.save_component(c)
            self._quarantine(c, f"{phase} of version {record.version} failed: {record.reason or 'no reason given'}")
        elif base:
            self.store.save_component(c)  # the base model: as trusted as at the run's start, no more, no less
        else:
            self.store.save_component(c)
            self._quarantine(c, f"version {record.version} is unverified: {record.reason or 'no reason given'}")
        self.events.publish(EventKind.UPDATE_REPORTED, c, version=record.version, update=record,
                            message=record.reason if not record.verified else "")
        return record

    def _publish_rewound_again(self, to_version: int, rewinding: list[str]) -> None:
        """Where the replicas going back cannot fetch the rewound version themselves, the trainer
        (resumed at it) is asked to publish it again: MEMORY bytes no longer held (a push of
        the same version is accepted then), NCCL (kept nowhere: the replicas await it, and the
        trainer broadcasts it to them). CHECKPOINT directories stay where they are."""
        record = self.catalog.latest_record()
        if record is None or record.version != to_version:
            return
        if self.push_requested:
            self.events.publish(EventKind.PUSH_REQUESTED, version=to_version,
                                message=f"the rewound version {to_version}'s bytes are not held; push them again")
        elif record.method == Method.NCCL:
            for cid in rewinding:
                c = self.registry.components[cid]
                c.requested_at, c.request_step, c.awaited_version = self._clock(), c.step, to_version
                self.registry.move(c, State.REQUIRE_SYNC, EventKind.SYNC_REQUESTED,
                                   message=f"rewound: awaits version {to_version} broadcast again")

    # -- time ----------------------------------------------------------------

    def sweep(self) -> None:
        """Expires leases, lapses DYNAMIC sync requests, aborts late transfers."""
        for c in self.registry.expire():
            self.transfers.member_left(c.id, "lease expired")
        if self.policy.style == Style.DYNAMIC_BY_EXPLORER:
            now, timeout = self._clock(), self.policy.timeout_seconds
            for c in self.registry.live(Role.ROLLOUT):
                if (
                    c.state == State.REQUIRE_SYNC
                    and c.requested_at is not None
                    and now - c.requested_at > timeout
                    and self.transfers.pending_for(c.id) is None
                ):
                    self.registry.move(c, State.RUNNING, message=f"sync request timed out after {timeout:g}s")
        self.transfers.sweep()
        self._refresh_metrics()

    # -- transfers (outcome side; allocation lives in the weight plane) --------

    def _transfer_finished(self, group: Group) -> None:
        committed = group.state == TransferState.COMMITTED
        for member_id, rank in group.members:
            c = self.registry.components.get(member_id)
            if c is None:
                continue
            if committed and rank > 0 and group.version > c.weight_version:
                c.weight_version = group.version
                if c.weight_version >= c.awaited_version:
                    c.last_sync_step = max(c.last_sync_step, c.request_step)
            if c.state == State.WAITING_SYNC:
                self.registry.move(c, State.RUNNING, message=f"transfer {group.group_id} {group.state.name.lower()}")
            elif committed and rank > 0:
                self.registry.touch(c, f"received version {group.version}")
        elapsed = self._clock() - group.started
        # The transfer's outcome is announced before the version it made is committed: a watcher that
        # stops once it has heard the newest version (the controller at a run's end) has then heard both.
        self.events.publish(
            EventKind.TRANSFER_FINISHED, version=group.version, method=Method.NCCL, location=group.group_id,
            group=group, transfer_state=group.state, message=group.error, identity=group.identity,
        )
        if committed:
            metrics.WEIGHT_SYNC_DURATION.labels("nccl").observe(elapsed)
            recorded = self.catalog.records.get(group.version)
            # A version at most the newest is a replica caught up, so already recorded; except the
            # version a rewind went back to, broadcast again by the resumed trainer: it is this
            # lineage's now, with the identity of what was sent (the replicas are judged against it).
            if group.version > self.catalog.latest or (recorded is not None and recorded.epoch < self.epoch):
                self.commit_version(VersionRecord(group.version, Method.NCCL, identity=group.identity,
                                                  tensors=group.tensors, probe=group.probe),
                                    location=group.group_id)
        else:
            metrics.WEIGHT_SYNC_FAILURES.labels("nccl").inc()
            log.warning("transfer aborted", extra={"group_id": group.group_id, "reason": group.error})

    def check_version(self, version: int, what: str, *, allow_equal: bool = False) -> None:
        latest = self.catalog.latest
        if version < 1:
            raise InvalidArgument(f"{what}: version must be >= 1, got {version}")
        if version < latest or (version == latest and not allow_equal):
            raise FailedPrecondition(
                f"{what}: version {version} is not newer than the newest committed version {latest}"
            )
