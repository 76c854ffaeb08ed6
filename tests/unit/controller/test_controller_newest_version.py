"""The newest committed version has one holder in the controller (weights/newest.py), which the
fleet writes and the observer and the deployed watch read: no copy drifts from it (the layout
rule is tests/unit/test_layout_controller.py)."""

from __future__ import annotations

import asyncio

from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.types import EventKind, Method
from services.controller.testing.simulated import run_virtual
from tests.unit.controller.controller_helpers import config, simulated_pipeline


def event(kind: EventKind, latest: int, version: int, seq: int) -> WatchEvent:
    return WatchEvent(kind, seq, 1_000 * seq, latest, None, version,
                      Method.MEMORY if kind == EventKind.VERSION_COMMITTED else None, "", None, None, "")


def test_after_a_rewind_the_run_end_still_waits_for_the_newest_versions_events() -> None:
    """The synchronizer was rewound from 5 to 2, and the trainer has since published 3: the run's end
    waits until the events of version 3 are recorded (a copy that only ever rose would think 5 >= 3
    and cut them off)."""
    p, _, _ = simulated_pipeline(config())
    observer, fleet = p.observer, p.fleet
    assert observer.newest is fleet.newest  # one holder, read by both

    async def newest_is_3() -> int:
        return 3

    async def scenario() -> tuple[float, list[int]]:
        observer.ask_newest = newest_is_3
        observer.observe(event(EventKind.VERSION_COMMITTED, 5, 5, 1))
        observer.observe(event(EventKind.REWOUND, 2, 2, 2))
        assert fleet.newest.value == 2

        async def publish_later() -> None:
            await asyncio.sleep(1.0)
            observer.observe(event(EventKind.VERSION_COMMITTED, 3, 3, 3))

        later = asyncio.ensure_future(publish_later())
        loop = asyncio.get_running_loop()
        started = loop.time()
        await observer.catch_up(timeout=5.0)
        await later
        return loop.time() - started, [e["latest_version"] for e in observer.timeline]

    waited, heard = run_virtual(scenario())
    assert waited == 1.0 and heard == [5, 2, 3]
