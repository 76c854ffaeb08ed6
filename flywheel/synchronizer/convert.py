"""Protobuf <-> domain conversions, shared by the servicer and the client."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from flywheel.common.types import pause_mode_from_pb, pause_mode_to_pb
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.codec.identity import IDENTITY_BYTES
from flywheel.errors import InvalidArgument
from flywheel.probe import ProbeBatch, ProbeCheck, ProbeStatistic
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
    UpdateCoverage,
    UpdateOutcome,
    UpdatePhase,
    UpdateRecord,
    UpdateTimings,
)

#: Most log-probs a probe batch may carry (flywheel.probe's is 4 x 63): a bound on what the
#: synchronizer records and persists with every version.
MAX_PROBE_TOKENS = 1 << 16


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
        prepare_seconds=t.prepare_seconds,
    )


def timings_from_pb(msg: pb.UpdateTimings) -> UpdateTimings:
    values = (msg.admit_seconds, msg.transfer_seconds, msg.apply_seconds, msg.verify_seconds, msg.reopen_seconds,
              msg.pause_seconds, msg.prepare_seconds)
    if not all(v >= 0 for v in values):  # NaN included
        raise InvalidArgument(f"timings: every duration must be >= 0 seconds, got {list(values)}")
    return UpdateTimings(*values)


def probe_check_to_pb(c: ProbeCheck) -> pb.ProbeCheck:
    return pb.ProbeCheck(ran=c.ran, tokens=c.tokens, max_abs_diff=c.max_abs_diff, mean_abs_diff=c.mean_abs_diff,
                         tolerance=c.tolerance, passed=c.passed, median_abs_diff=c.median_abs_diff,
                         statistic=c.statistic.value)


def probe_check_from_pb(msg: pb.ProbeCheck) -> ProbeCheck:
    """A replica's probe check; INVALID_ARGUMENT when its numbers contradict each other (a pass
    must have run over some tokens, held its statistic within its tolerance, and seen no token
    without a finite difference). An unset statistic
    is the largest difference, what every check held before the median existed."""
    diffs = (msg.max_abs_diff, msg.mean_abs_diff, msg.median_abs_diff)
    if any(math.isnan(d) or d < 0 for d in diffs) or not (math.isfinite(msg.tolerance) and msg.tolerance >= 0):
        raise InvalidArgument(f"coverage.probe: differences must be >= 0 nats and the tolerance finite and >= 0, got "
                              f"max {msg.max_abs_diff}, mean {msg.mean_abs_diff}, median {msg.median_abs_diff}, "
                              f"tolerance {msg.tolerance}")
    if msg.max_abs_diff < msg.median_abs_diff:
        raise InvalidArgument(f"coverage.probe: the median difference {msg.median_abs_diff} exceeds the largest "
                              f"{msg.max_abs_diff}")
    try:
        statistic = ProbeStatistic(msg.statistic or pb.PROBE_STATISTIC_MAX)
    except ValueError:
        raise InvalidArgument(f"coverage.probe: unknown statistic {msg.statistic}") from None
    check = ProbeCheck(msg.ran, msg.tokens, msg.max_abs_diff, msg.mean_abs_diff, msg.tolerance, msg.passed,
                       median_abs_diff=msg.median_abs_diff, statistic=statistic)
    if check.passed and not (check.ran and check.tokens > 0 and check.held <= check.tolerance
                             and math.isfinite(check.max_abs_diff)):
        raise InvalidArgument(f"coverage.probe: a pass needs a probe that ran over some tokens within its tolerance; "
                              f"got ran={check.ran}, tokens={check.tokens}, {statistic.name.lower()} |diff| "
                              f"{check.held} against tolerance {check.tolerance}")
    return check


def coverage_to_pb(c: UpdateCoverage) -> pb.UpdateCoverage:
    return pb.UpdateCoverage(
        tensors=c.tensors, bytes=c.bytes, resident_tensors=c.resident_tensors, resident_bytes=c.resident_bytes,
        received_tensors=c.received_tensors, received_bytes=c.received_bytes, probe=probe_check_to_pb(c.probe),
    )


def coverage_from_pb(msg: pb.UpdateCoverage) -> UpdateCoverage:
    """What a replica measured; INVALID_ARGUMENT when it counts more measured than there is."""
    if msg.resident_tensors + msg.received_tensors > msg.tensors or msg.resident_bytes + msg.received_bytes > msg.bytes:
        raise InvalidArgument(
            f"coverage: {msg.resident_tensors} resident + {msg.received_tensors} received tensors "
            f"({msg.resident_bytes} + {msg.received_bytes} bytes) exceed the version's {msg.tensors} tensors "
            f"({msg.bytes} bytes); a tensor is counted once")
    return UpdateCoverage(msg.tensors, msg.bytes, msg.resident_tensors, msg.resident_bytes, msg.received_tensors,
                          msg.received_bytes, probe_check_from_pb(msg.probe))


def update_to_pb(r: UpdateRecord) -> pb.UpdateRecord:
    return pb.UpdateRecord(
        component_id=r.component_id, version=r.version, expected_identity=r.expected_identity,
        resident_identity=r.resident_identity, outcome=int(r.outcome),
        failed_phase=int(r.failed_phase) if r.failed_phase else 0, reason=r.reason, timings=timings_to_pb(r.timings),
        unix_ms=r.unix_ms, epoch=r.epoch, served_version=r.served_version, coverage=coverage_to_pb(r.coverage),
    )


def update_from_pb(msg: pb.UpdateRecord) -> UpdateRecord:
    return UpdateRecord(
        msg.component_id, msg.version, UpdateOutcome(msg.outcome or UpdateOutcome.FAILED), msg.expected_identity,
        msg.resident_identity, UpdatePhase(msg.failed_phase) if msg.failed_phase else None, msg.reason,
        timings_from_pb(msg.timings), msg.unix_ms, msg.epoch, msg.served_version, coverage_from_pb(msg.coverage),
    )


def update_report_from_pb(msg: pb.ReportUpdateRequest) -> UpdateRecord:
    """A rollout's report as a record (its own verdict; the synchronizer judges it next)."""
    if not msg.id:
        raise InvalidArgument("id: empty")
    try:
        outcome = UpdateOutcome(msg.outcome)
    except ValueError:
        raise InvalidArgument(f"outcome: must be VERIFIED, UNVERIFIED or FAILED, got {msg.outcome}") from None
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
        coverage=coverage_from_pb(msg.coverage),
    )


def tensor_digests_to_pb(tensors: Mapping[str, bytes]) -> list[pb.TensorDigest]:
    """Each tensor's identity digest, in name order."""
    return [pb.TensorDigest(name=name, digest=tensors[name]) for name in sorted(tensors)]


def tensor_digests_from_pb(msgs: Iterable[pb.TensorDigest], what: str) -> dict[str, bytes]:
    """Name -> digest; INVALID_ARGUMENT for a nameless, repeated or malformed entry."""
    tensors: dict[str, bytes] = {}
    for t in msgs:
        if not t.name:
            raise InvalidArgument(f"{what}: a tensor digest without a tensor name")
        if t.name in tensors:
            raise InvalidArgument(f"{what}: tensor {t.name!r} is listed twice")
        if len(t.digest) != IDENTITY_BYTES:
            raise InvalidArgument(f"{what}: tensor {t.name!r}: a digest is {IDENTITY_BYTES} bytes (XXH3-128), "
                                  f"got {len(t.digest)}")
        tensors[t.name] = bytes(t.digest)
    return tensors


def probe_from_pb(msg: cpb.ProbeBatch, what: str) -> ProbeBatch | None:
    """A trainer's probe batch (None: none sent); INVALID_ARGUMENT for a malformed one, one larger
    than MAX_PROBE_TOKENS, or log-probs that are not finite (a model that computes NaN has no
    version worth proving)."""
    try:
        probe = ProbeBatch.from_pb(msg)
    except ValueError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None
    if probe is None:
        return None
    if probe.tokens > MAX_PROBE_TOKENS:
        raise InvalidArgument(f"{what}: {probe.tokens} log-probs; a probe holds at most {MAX_PROBE_TOKENS}")
    if not all(math.isfinite(x) for row in probe.logprobs for x in row):
        raise InvalidArgument(f"{what}: every log-prob must be finite")
    return probe


def identity_bytes(value: bytes, what: str) -> bytes:
    """A weight identity from the wire: 16 bytes, or none."""
    if value and len(value) != IDENTITY_BYTES:
        raise InvalidArgument(f"{what}: an identity is {IDENTITY_BYTES} bytes (XXH3-128), got {len(value)}")
    return bytes(value)
