"""Protobuf <-> domain conversions, shared by the servicer and the client."""

from __future__ import annotations

from flywheel.common.types import pause_mode_from_pb, pause_mode_to_pb
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.codec.identity import IDENTITY_BYTES
from flywheel.errors import InvalidArgument
from flywheel.runtime.addresses import check_address
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.synchronizer.types import (
    Component,
    GroupInfo,
    Identity,
    Method,
    Policy,
    RolloutWait,
    Role,
    State,
    Style,
    UpdateOutcome,
    UpdatePhase,
    UpdateRecord,
    UpdateTimings,
)


def identity_from_pb(msg: cpb.ComponentIdentity) -> Identity:
    if msg.role not in (r.value for r in Role):
        raise InvalidArgument(f"identity.role: must be one of {', '.join(r.name for r in Role)}, got {msg.role}")
    try:
        capabilities = frozenset(Method(m) for m in msg.capabilities)
    except ValueError:
        raise InvalidArgument(f"identity.capabilities: unknown method in {list(msg.capabilities)}") from None
    # Others dial it (the controller a replica, replicas a relay or a peer): refused now, not when dialled.
    address = check_address(msg.address, "identity.address") if msg.address else ""
    return Identity(Role(msg.role), msg.id, address, capabilities, dict(msg.labels))


def identity_to_pb(identity: Identity) -> cpb.ComponentIdentity:
    return cpb.ComponentIdentity(
        role=int(identity.role), id=identity.id, address=identity.address,
        capabilities=sorted(int(m) for m in identity.capabilities), labels=identity.labels,
    )


def component_to_pb(c: Component) -> cpb.ComponentStatus:
    return cpb.ComponentStatus(
        identity=identity_to_pb(c.identity), state=int(c.state), step=c.step,
        weight_version=c.weight_version, last_heartbeat_unix_ms=c.last_heartbeat_ms,
        weight_identity=c.weight_identity, quarantined=c.quarantined, quarantine_reason=c.quarantine_reason,
    )


def component_from_pb(msg: cpb.ComponentStatus) -> Component:
    identity = Identity(
        Role(msg.identity.role) if msg.identity.role else Role.CONTROLLER, msg.identity.id, msg.identity.address,
        frozenset(Method(m) for m in msg.identity.capabilities if m), dict(msg.identity.labels),
    )
    state = State(msg.state) if msg.state else State.STOPPED
    return Component(identity, state, msg.step, msg.weight_version, msg.last_heartbeat_unix_ms,
                     weight_identity=msg.weight_identity, quarantined=msg.quarantined,
                     quarantine_reason=msg.quarantine_reason)


def state_from_pb(value: int, what: str, *, optional: bool = False) -> State | None:
    if value == cpb.COMPONENT_STATE_UNSPECIFIED:
        if optional:
            return None
        raise InvalidArgument(f"{what}: a state is required (STOPPED, RUNNING, REQUIRE_SYNC or WAITING_SYNC)")
    try:
        return State(value)
    except ValueError:
        raise InvalidArgument(f"{what}: unknown state {value}") from None


def group_to_pb(group) -> pb.AllocateGroupResponse:
    """`groups.Group` (or GroupInfo) -> AllocateGroupResponse."""
    members = group.members if hasattr(group, "members") else list(group.ranks.items())
    return pb.AllocateGroupResponse(
        group_id=group.group_id, rendezvous_address=group.rendezvous_address, world_size=group.world_size,
        backend=group.backend, members=[pb.GroupMember(id=cid, rank=rank) for cid, rank in members],
        deadline_unix_ms=group.deadline_unix_ms, version=group.version,
    )


def group_from_pb(msg: pb.AllocateGroupResponse) -> GroupInfo | None:
    if not msg.group_id:
        return None
    return GroupInfo(
        group_id=msg.group_id, version=msg.version, rendezvous_address=msg.rendezvous_address,
        world_size=msg.world_size, backend=msg.backend, ranks={m.id: m.rank for m in msg.members},
        deadline_unix_ms=msg.deadline_unix_ms,
    )


def policy_to_pb(policy: Policy) -> pb.ConfigurePolicyRequest:
    return pb.ConfigurePolicyRequest(
        style=int(policy.style), method=int(policy.method), sync_interval=policy.interval,
        sync_offset=policy.offset, sync_timeout_seconds=policy.timeout_seconds,
        rollout_wait=int(policy.rollout_wait), max_staleness=policy.max_staleness,
        pause_mode=pause_mode_to_pb(policy.pause_mode),
    )


def policy_from_status_pb(msg: pb.ConfigurePolicyRequest) -> Policy:
    """The active policy as a status or NeedSync answer carries it (every field set)."""
    return Policy(
        Style(msg.style or Style.FIXED), Method(msg.method or Method.MEMORY), msg.sync_interval, msg.sync_offset, msg.sync_timeout_seconds,
        RolloutWait(msg.rollout_wait) if msg.rollout_wait else RolloutWait.NONE, msg.max_staleness,
        _pause_mode(msg.pause_mode) or "",
    )


def _pause_mode(value: int) -> str | None:
    try:
        return pause_mode_from_pb(value)
    except ValueError:
        raise InvalidArgument(f"pause_mode: unknown pause mode {value}") from None


def policy_from_pb(msg: pb.ConfigurePolicyRequest) -> dict:
    """Keyword arguments for `Synchronizer.configure_policy` (zero fields: keep)."""
    try:
        style = Style(msg.style) if msg.style else None
        method = Method(msg.method) if msg.method else None
        rollout_wait = RolloutWait(msg.rollout_wait) if msg.rollout_wait else None
    except ValueError:
        raise InvalidArgument(
            f"unknown style {msg.style}, method {msg.method} or rollout_wait {msg.rollout_wait}"
        ) from None
    if msg.sync_timeout_seconds < 0:
        raise InvalidArgument(f"sync_timeout_seconds must be positive, got {msg.sync_timeout_seconds}")
    return dict(
        style=style, method=method, interval=msg.sync_interval, offset=msg.sync_offset,
        timeout_seconds=msg.sync_timeout_seconds, rollout_wait=rollout_wait, max_staleness=msg.max_staleness,
        pause_mode=_pause_mode(msg.pause_mode),
    )


def timings_to_pb(t: UpdateTimings) -> pb.UpdateTimings:
    return pb.UpdateTimings(
        admit_seconds=t.admit_seconds, transfer_seconds=t.transfer_seconds, apply_seconds=t.apply_seconds,
        verify_seconds=t.verify_seconds, reopen_seconds=t.reopen_seconds, pause_seconds=t.pause_seconds,
    )


def timings_from_pb(msg: pb.UpdateTimings) -> UpdateTimings:
    values = (msg.admit_seconds, msg.transfer_seconds, msg.apply_seconds, msg.verify_seconds, msg.reopen_seconds,
              msg.pause_seconds)
    if not all(v >= 0 for v in values):  # NaN included
        raise InvalidArgument(f"timings: every duration must be >= 0 seconds, got {list(values)}")
    return UpdateTimings(*values)


def update_to_pb(r: UpdateRecord) -> pb.UpdateRecord:
    return pb.UpdateRecord(
        component_id=r.component_id, version=r.version, expected_identity=r.expected_identity,
        resident_identity=r.resident_identity, outcome=int(r.outcome),
        failed_phase=int(r.failed_phase) if r.failed_phase else 0, reason=r.reason, timings=timings_to_pb(r.timings),
        unix_ms=r.unix_ms, epoch=r.epoch, served_version=r.served_version,
    )


def update_from_pb(msg: pb.UpdateRecord) -> UpdateRecord:
    return UpdateRecord(
        msg.component_id, msg.version, UpdateOutcome(msg.outcome or UpdateOutcome.FAILED), msg.expected_identity,
        msg.resident_identity, UpdatePhase(msg.failed_phase) if msg.failed_phase else None, msg.reason,
        timings_from_pb(msg.timings), msg.unix_ms, msg.epoch, msg.served_version,
    )


def update_report_from_pb(msg: pb.ReportUpdateRequest) -> UpdateRecord:
    """A rollout's report as a record (its own verdict; the synchronizer judges it next)."""
    if not msg.id:
        raise InvalidArgument("id: empty")
    try:
        outcome = UpdateOutcome(msg.outcome)
    except ValueError:
        raise InvalidArgument(f"outcome: must be VERIFIED or FAILED, got {msg.outcome}") from None
    try:
        phase = UpdatePhase(msg.failed_phase) if msg.failed_phase else None
    except ValueError:
        raise InvalidArgument(f"failed_phase: unknown phase {msg.failed_phase}") from None
    if outcome == UpdateOutcome.FAILED and phase is None:
        raise InvalidArgument("failed_phase: a FAILED update names the phase that failed")
    if msg.resident_identity and len(msg.resident_identity) != IDENTITY_BYTES:
        raise InvalidArgument(f"resident_identity: {IDENTITY_BYTES} bytes or none, got {len(msg.resident_identity)}")
    return UpdateRecord(
        msg.id, msg.version, outcome, resident_identity=msg.resident_identity, failed_phase=phase,
        reason=msg.reason[:4000], timings=timings_from_pb(msg.timings), served_version=msg.served_version,
    )


def identity_bytes(value: bytes, what: str) -> bytes:
    """A weight identity from the wire: 16 bytes, or none."""
    if value and len(value) != IDENTITY_BYTES:
        raise InvalidArgument(f"{what}: an identity is {IDENTITY_BYTES} bytes (XXH3-128), got {len(value)}")
    return bytes(value)
