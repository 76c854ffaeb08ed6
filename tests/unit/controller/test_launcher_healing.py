"""The launcher's restart bookkeeping: bounded, spaced by a doubling backoff, and said plainly."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.controller.launcher.healing import Healer, Restart, RestartPolicy
from services.controller.launcher.spec import split_run_file


def test_restarts_are_bounded_and_the_backoff_doubles_up_to_its_cap() -> None:
    healer = Healer(RestartPolicy(max_restarts=4, backoff_seconds=2.0, max_backoff_seconds=5.0))
    waits = []
    while healer.may_restart():
        waits.append(healer.backoff())
        healer.record(Restart("trainer", -9, at_step=3, action="rewound"))
    assert waits == [2.0, 4.0, 5.0, 5.0]
    assert len(healer.summary()) == 4 and healer.summary()[0]["service"] == "trainer"


def test_no_restarts_when_turned_off() -> None:
    assert not Healer(RestartPolicy(max_restarts=0)).may_restart()


def test_each_restart_says_what_died_what_was_done_and_what_is_redone() -> None:
    replica = Restart("rollout", -9, at_step=5, action="restarted", redo_from_step=6)
    assert replica.describe() == "rollout died (exit -9) at step 5: restarted it; the run goes on"
    rewind = Restart("trainer", -9, at_step=7, action="rewound", resumed_from="/r/checkpoints/global_step_4",
                     redo_from_step=5)
    assert rewind.describe() == ("trainer died (exit -9) at step 7: restarted every service and resumed from "
                                 "/r/checkpoints/global_step_4; steps 5-7 are redone")
    one = Restart("synchronizer", -9, at_step=5, action="rewound", resumed_from="/c/global_step_4", redo_from_step=5)
    assert one.describe().endswith("step 5 is redone")
    early = Restart("trainer", 1, at_step=0, action="rewound", redo_from_step=1)
    assert early.describe().endswith("resumed from the start (no checkpoint yet); nothing is redone")


def test_the_run_file_sets_the_policy_and_rejects_nonsense() -> None:
    spec, _ = split_run_file({"launch": {"restarts": {"max_restarts": 2, "backoff_seconds": 0.5}}}, "test")
    assert (spec.restarts.max_restarts, spec.restarts.backoff_seconds) == (2, 0.5)
    assert split_run_file({}, "test")[0].restarts.max_restarts == 5
    with pytest.raises(Exception, match="launch.restarts.max_restarts"):
        split_run_file({"launch": {"restarts": {"max_restarts": -1}}}, "test")
    with pytest.raises(ValidationError):
        RestartPolicy(retries=3)
