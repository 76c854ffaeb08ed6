"""When to sync: the FIXED and DYNAMIC_BY_EXPLORER policies as pure functions.

Steps count completed steps (trainer: optimizer steps, rollout: batches
produced); the weight version a trainer publishes after step s is s.

FIXED(interval, offset): the trainer syncs after every step that is a
multiple of `interval`; the rollout side runs `offset` steps ahead and syncs
after steps offset + k*interval (k >= 1), to the version the trainer made
`offset` steps earlier (step - offset). (10, 0): both sync at 10, 20, ...;
(10, 5): rollouts sync at 15, 25, ... to versions 10, 20, ... A side whose
sync failed (an aborted transfer, a lapsed wait) is told to sync again at
its next step, until it holds the version of its last sync point: FIXED is
a schedule both sides keep, not a one-shot chance.

NCCL versions are kept nowhere a rollout could pull them from: a rollout
that registers behind the newest one (it joined mid-run or restarted) awaits
it at once, and the trainer broadcasts it again, to the rollouts behind it
only, while its step is that version; otherwise the next broadcast, which
takes every rollout behind, brings it along.

Outside either schedule, a version can be asked for (RequestVersion: the
start of a run or a resume, a validation measuring the weights it names):
the trainer publishes as soon as its step reaches the version asked for.

DYNAMIC_BY_EXPLORER(interval, timeout): a rollout asks for new weights
(REQUIRE_SYNC) once `interval` steps passed since its last satisfied request,
awaiting any version newer than its own; the trainer syncs whenever some
rollout awaits a version it has not published yet. A request older than
`timeout` lapses (back to RUNNING) and the rollout asks again next step.

`decide` answers NeedSync for either side from the component and what the
service knows; it returns the state the component should move to, which
the service applies (the tables: trainer RUNNING <-> WAITING_SYNC with NCCL,
RUNNING otherwise; rollout RUNNING -> REQUIRE_SYNC, then WAITING_SYNC when
it joins an NCCL group, RUNNING once it holds the version).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.synchronizer.types import Component, Method, Policy, Role, RolloutWait, State, Style


@dataclass(frozen=True)
class Decision:
    need_sync: bool
    #: Trainer: the version to publish. Rollout: the lowest version to move to.
    version: int
    #: The state the component should be in after the call.
    state: State
    #: The component just made a new request (rollouts entering REQUIRE_SYNC).
    new_request: bool = False


def validate(policy: Policy) -> Policy:
    if policy.interval < 1:
        raise InvalidArgument(f"sync_interval must be at least 1 step, got {policy.interval}")
    if policy.offset < 0:
        raise InvalidArgument(f"sync_offset must be >= 0, got {policy.offset}")
    if policy.max_staleness < 0:
        raise InvalidArgument(f"max_staleness must be >= 0, got {policy.max_staleness}")
    if policy.timeout_seconds <= 0:
        raise InvalidArgument(f"sync_timeout_seconds must be positive, got {policy.timeout_seconds}")
    return policy


def fixed_trainer_syncs(step: int, interval: int) -> bool:
    """Whether `step` is a trainer sync point."""
    return step > 0 and step % interval == 0


def fixed_rollout_syncs(step: int, interval: int, offset: int) -> bool:
    """Whether `step` is a rollout sync point."""
    return step > offset and (step - offset) % interval == 0


def fixed_due_version(step: int, interval: int, offset: int) -> int:
    """The version a side at `step` must hold by FIXED: that of its last sync
    point (offset 0 for the trainer), or 0 before the first one."""
    if step <= offset:
        return 0
    return (step - offset) // interval * interval


def required_version(policy: Policy | None, run_step: int, due: int) -> int:
    """The version a rollout's generation for `run_step` (the train batch it is for, from 1)
    waits for under the policy's `rollout_wait`; `due` is what NeedSync named at step
    run_step - 1 (0: nothing). Sync mode: exactly the schedule's version; batch-async: at
    most `max_staleness` behind the version it is trained against (run_step - 1); fully-async:
    nothing."""
    if policy is None or run_step < 1:
        return 0
    if policy.rollout_wait == RolloutWait.DUE_VERSION:
        return due
    if policy.rollout_wait == RolloutWait.STALENESS:
        return max(0, run_step - 1 - policy.max_staleness)
    return 0


def dynamic_rollout_due(step: int, last_sync_step: int, interval: int) -> bool:
    return step - last_sync_step >= interval


def _awaiting(c: Component) -> bool:
    return c.state in (State.REQUIRE_SYNC, State.WAITING_SYNC)


def trainer_decision(
    policy: Policy, trainer: Component, step: int, latest: int, rollouts: Iterable[Component], push_requested: bool,
    wanted: int = 0,
) -> Decision:
    if push_requested and policy.method == Method.MEMORY:
        # The newest version's bytes were lost: publish the current weights again.
        return Decision(True, max(step, latest), trainer.state)
    if latest < wanted <= step:
        # A version was asked for outside the schedule (a run's start, a validation): this one will do.
        need = True
    elif step <= latest:
        # This step's version (or a newer one) is out already. Over NCCL it is
        # kept nowhere: a rollout that awaits it and missed the broadcast (it
        # joined later, its transfer failed, or a rewind sent it back from a newer one) gets it
        # again, while the trainer still holds exactly those weights.
        need = policy.method == Method.NCCL and step == latest and any(
            _awaiting(r) and r.awaited_version <= latest and r.weight_version != r.awaited_version for r in rollouts)
    elif policy.style == Style.FIXED:
        due = fixed_due_version(step, policy.interval, 0)
        need = due > 0 and latest < due
    else:
        need = any(_awaiting(r) and r.awaited_version > latest for r in rollouts)
    state = trainer.state
    if need and policy.method == Method.NCCL and state == State.RUNNING:
        state = State.WAITING_SYNC
    return Decision(need, step if need else latest, state)


def rollout_decision(policy: Policy, rollout: Component, step: int) -> Decision:
    if _awaiting(rollout):
        return Decision(True, rollout.awaited_version, rollout.state)
    if policy.style == Style.FIXED:
        target = fixed_due_version(step, policy.interval, policy.offset)
        need = 0 < target and rollout.weight_version < target
    else:
        target = rollout.weight_version + 1
        need = dynamic_rollout_due(step, rollout.last_sync_step, policy.interval)
    if not need:
        return Decision(False, rollout.weight_version, rollout.state)
    return Decision(True, target, State.REQUIRE_SYNC, new_request=True)


def decide(
    policy: Policy,
    component: Component,
    step: int,
    latest: int,
    rollouts: Iterable[Component],
    push_requested: bool = False,
    wanted: int = 0,
) -> Decision:
    """`wanted`: the least version asked for outside the schedule and not committed yet (0: none)."""
    if component.state == State.STOPPED:
        raise FailedPrecondition(f"{component.role.name.lower()} {component.id!r} is STOPPED; register it again")
    if component.role == Role.TRAINER:
        return trainer_decision(policy, component, step, latest, rollouts, push_requested, wanted)
    if component.role == Role.ROLLOUT:
        return rollout_decision(policy, component, step)
    raise InvalidArgument(f"NeedSync is for trainers and rollouts; {component.id!r} is a {component.role.name.lower()}")
