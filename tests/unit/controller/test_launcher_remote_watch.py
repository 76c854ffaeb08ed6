"""What the deployed run's watch makes of the services' answers (healing.RemoteWatch), and
how the deployed remedies are said."""

from __future__ import annotations

from services.controller.launcher.healing import RemoteWatch, Restart


class Service:
    """A fake service: answers `value` (a step, None: not loaded; the synchronizer: its newest version
    and `policy`), or raises when down."""

    def __init__(self, value: int | None, policy: str | None = None) -> None:
        self.value, self.policy, self.up = value, policy, True

    async def __call__(self) -> object:
        if not self.up:
            raise ConnectionError("refused")
        return self.value if self.policy is None else (self.value, self.policy)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_service_is_down_only_after_down_after_seconds_without_an_answer() -> None:
    trainer, synchronizer, clock = Service(3), Service(3, "run's"), Clock()
    watch = RemoteWatch(trainer, synchronizer, down_after=3.0, clock=clock)
    assert await watch.look(3, 3) == []
    trainer.up = False
    assert await watch.look(3, 3) == []  # one failed answer on a busy machine is not a death
    clock.now += 2.0
    assert await watch.look(3, 3) == []
    clock.now += 1.5
    assert await watch.look(3, 3) == [("trainer", "down")]
    assert await watch.look(3, 3) == []  # said once
    trainer.up = True  # the same process: nothing lost
    assert await watch.look(3, 3) == [("trainer", "back")]
    trainer.value = 4
    assert await watch.look(3, 3) == []  # a step ahead of the run: it trained one the run has not recorded yet


async def test_a_trainer_that_answers_with_less_than_the_run_had_died() -> None:
    trainer = Service(5)
    watch = RemoteWatch(trainer, None)
    assert await watch.look(5, 5) == []
    trainer.value = None  # a new process, still loading its model
    assert await watch.look(5, 5) == [("trainer", "died")]
    trainer.value = 0  # a new process, loaded: its base weights
    assert await watch.look(5, 5) == [("trainer", "died")]


async def test_a_synchronizer_is_back_after_being_down_or_when_its_newest_version_went_backwards() -> None:
    trainer, synchronizer, clock = Service(6), Service(4, "run's"), Clock()
    watch = RemoteWatch(trainer, synchronizer, down_after=1.0, clock=clock)
    assert await watch.look(4, 4) == []
    synchronizer.value = 0  # restarted between two looks: empty
    assert await watch.look(4, 4) == [("synchronizer", "back")]
    assert await watch.look(4, 4) == []  # found once: the run is handing it its version back
    synchronizer.value = 5  # the trainer published again
    assert await watch.look(5, 5) == []
    synchronizer.up = False
    await watch.look(5, 5)
    clock.now += 1.0
    assert await watch.look(5, 5) == [("synchronizer", "down")]
    synchronizer.up, synchronizer.value = True, 6
    assert await watch.look(6, 6) == [("synchronizer", "back")]
    assert await watch.look(6, 6) == []  # the run gave it its policy again: learnt now


async def test_a_synchronizer_restarted_between_two_looks_is_known_by_its_policy() -> None:
    """A pod restarts in a second: never seen down, and the trainer may have published again already."""
    synchronizer = Service(4, "run's")
    watch = RemoteWatch(Service(5), synchronizer)
    assert await watch.look(4, 4) == []
    synchronizer.value, synchronizer.policy = 5, "default"
    assert await watch.look(5, 5) == [("synchronizer", "back")]
    synchronizer.policy = "run's"
    assert await watch.look(5, 5) == []


async def test_a_synchronizer_restarted_before_the_first_look_is_known_by_the_runs_newest_version() -> None:
    """The watch keeps no version of its own: it compares with the newest one the run heard committed.
    A synchronizer that restarted before the first look has no earlier answer to fall behind, and
    its policy (its own default, here equal to the run's) is all the watch has seen of it."""
    synchronizer = Service(2, "run's")
    watch = RemoteWatch(Service(6), synchronizer)
    assert await watch.look(6, 6) == [("synchronizer", "back")]  # the run heard version 6 committed


def test_the_deployed_remedies_are_said_plainly() -> None:
    caught_up = Restart("synchronizer", None, at_step=3, action="caught up", redo_from_step=4)
    assert caught_up.describe() == ("synchronizer died at step 3: it came back empty; handed it the run's policy "
                                    "and weights; nothing is redone")
    resumed = Restart("trainer", None, at_step=5, action="resumed", resumed_from="/data/checkpoints/global_step_4",
                      redo_from_step=5)
    assert resumed.describe() == ("trainer died at step 5: resumed the run from /data/checkpoints/global_step_4 "
                                  "once it answered again; step 5 is redone")
