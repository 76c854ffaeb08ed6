"""The sync policies as pure functions, against the schedules the issue gives."""

from __future__ import annotations

import pytest

from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.synchronizer.policy import (
    decide,
    dynamic_rollout_due,
    fixed_due_version,
    fixed_rollout_syncs,
    fixed_trainer_syncs,
    validate,
)
from flywheel.synchronizer.types import Component, Identity, Method, Policy, Role, State, Style


def comp(role: Role, state: State = State.RUNNING, version: int = 0, **kw) -> Component:
    return Component(Identity(role, f"{role.name.lower()}-0"), state=state, weight_version=version, **kw)


def test_fixed_10_0_both_sides_sync_every_10_steps_together() -> None:
    steps = range(1, 41)
    assert [s for s in steps if fixed_trainer_syncs(s, 10)] == [10, 20, 30, 40]
    assert [s for s in steps if fixed_rollout_syncs(s, 10, 0)] == [10, 20, 30, 40]
    assert [fixed_due_version(s, 10, 0) for s in (9, 10, 19, 20, 40)] == [0, 10, 10, 20, 40]


def test_fixed_10_5_rollout_runs_5_steps_ahead_then_every_10() -> None:
    steps = range(1, 41)
    assert [s for s in steps if fixed_rollout_syncs(s, 10, 5)] == [15, 25, 35]
    # ... to the version the trainer made 5 steps earlier
    assert [fixed_due_version(s, 10, 5) for s in (5, 14, 15, 25, 35, 40)] == [0, 0, 10, 20, 30, 30]


def test_fixed_decisions_over_40_steps_match_the_tables() -> None:
    for policy in (Policy(Style.FIXED, Method.MEMORY, 10, 5), Policy(Style.FIXED, Method.NCCL, 10, 0)):
        trainer, rollout, latest = comp(Role.TRAINER), comp(Role.ROLLOUT), 0
        trainer_syncs, rollout_syncs = [], []
        for step in range(1, 41):
            d = decide(policy, trainer, step, latest, [rollout])
            if d.need_sync:
                trainer_syncs.append((step, d.version))
                assert d.state == (State.WAITING_SYNC if policy.method == Method.NCCL else State.RUNNING)
                latest = d.version  # the trainer publishes
            d = decide(policy, rollout, step, latest, [])
            if d.need_sync:
                assert d.state == State.REQUIRE_SYNC and d.new_request
                rollout_syncs.append((step, d.version))
                rollout.weight_version = d.version  # and it pulls
        assert trainer_syncs == [(10, 10), (20, 20), (30, 30), (40, 40)]
        if policy.offset == 5:
            assert rollout_syncs == [(15, 10), (25, 20), (35, 30)]
        else:
            assert rollout_syncs == [(10, 10), (20, 20), (30, 30), (40, 40)]


def test_fixed_failed_sync_is_retried_next_step_on_both_sides() -> None:
    policy = Policy(Style.FIXED, Method.NCCL, 10, 0)
    trainer, rollout = comp(Role.TRAINER), comp(Role.ROLLOUT)
    # The transfer of version 10 aborted: neither side has it at step 11.
    assert decide(policy, trainer, 11, 0, [rollout]).need_sync
    assert decide(policy, trainer, 11, 0, [rollout]).version == 11
    d = decide(policy, rollout, 11, 0, [])
    assert d.need_sync and d.version == 10
    # Once published, the trainer is not asked again within the interval.
    assert not decide(policy, trainer, 12, 11, [rollout]).need_sync


def test_dynamic_rollout_asks_after_interval_and_trainer_follows() -> None:
    policy = Policy(Style.DYNAMIC_BY_EXPLORER, Method.MEMORY, 3, 0, 5.0)
    trainer, rollout = comp(Role.TRAINER), comp(Role.ROLLOUT, version=2, last_sync_step=4)
    assert not dynamic_rollout_due(6, 4, 3) and dynamic_rollout_due(7, 4, 3)
    assert not decide(policy, rollout, 6, 2, []).need_sync
    assert not decide(policy, trainer, 9, 2, [rollout]).need_sync  # nobody asked
    d = decide(policy, rollout, 7, 2, [])
    assert d.need_sync and d.new_request and d.version == 3 and d.state == State.REQUIRE_SYNC
    rollout.state, rollout.awaited_version = State.REQUIRE_SYNC, 3
    assert decide(policy, trainer, 9, 2, [rollout]).need_sync  # the trainer sees the request
    assert not decide(policy, trainer, 9, 9, [rollout]).need_sync  # ... until it published
    again = decide(policy, rollout, 8, 2, [])
    assert again.need_sync and not again.new_request  # still waiting: same request


def test_trainer_is_asked_to_push_again_when_bytes_were_lost() -> None:
    policy = Policy(Style.FIXED, Method.MEMORY, 10, 0)
    d = decide(policy, comp(Role.TRAINER), 23, 20, [], push_requested=True)
    assert d.need_sync and d.version == 23


def test_stopped_and_controller_components_cannot_ask() -> None:
    policy = Policy()
    with pytest.raises(FailedPrecondition, match="STOPPED"):
        decide(policy, comp(Role.ROLLOUT, State.STOPPED), 1, 0, [])
    with pytest.raises(InvalidArgument, match="trainers and rollouts"):
        decide(policy, comp(Role.CONTROLLER), 1, 0, [])


@pytest.mark.parametrize("bad", [Policy(interval=0), Policy(offset=-1), Policy(timeout_seconds=0)])
def test_invalid_policies_are_rejected(bad: Policy) -> None:
    with pytest.raises(InvalidArgument):
        validate(bad)


def test_the_config_spellings_of_methods_and_styles_are_the_enums() -> None:
    """One owner: the configs' literals name exactly the enums' members (and so the wire's)."""
    from typing import get_args

    from flywheel.synchronizer.types import Method, Style, SyncMethodName, SyncStyleName, method_name

    assert set(get_args(SyncMethodName)) == {method_name(m) for m in Method}
    assert set(get_args(SyncStyleName)) == {s.name.lower() for s in Style}
