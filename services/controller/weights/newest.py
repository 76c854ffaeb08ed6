"""The newest weight version the synchronizer committed, as far as the
controller has heard: the one holder of that fact in the controller.

The synchronizer owns versions; the controller hears of its newest one on
every Watch event (`latest_version`), in RequestVersion's answer and in
Status. The fleet (weights/fleet.py) hears all three and is the only writer;
everyone else reads this object: the observer, so a run's end waits for the
newest version's events (weights/observer.py), and the deployed run's watch,
which knows a restarted synchronizer by a newest version older than the one
the run heard committed (launcher/healing.py). One holder, because copies
drift: a copy that only ever rises misses a rewind, one updated only at its
own polls misses what happened between them.
`tests/unit/test_layout_controller.py` fails when a second holder appears.

Only a rewind (REWOUND: the synchronizer dropped the versions above N) moves it back.
"""

from __future__ import annotations

import asyncio


class NewestVersion:
    def __init__(self) -> None:
        self._version = 0
        self._changed = asyncio.Event()

    @property
    def value(self) -> int:
        """The newest committed version heard of (0: none yet; version 0 is the base model)."""
        return self._version

    def heard(self, version: int) -> None:
        """The synchronizer said its newest committed version is `version`: an older answer
        (a stream behind the Status call that overtook it) changes nothing."""
        if version > self._version:
            self._set(version)

    def rewound(self, version: int) -> None:
        """The synchronizer dropped every version above `version` (a new lineage)."""
        if version != self._version:
            self._set(version)

    def changed(self) -> asyncio.Event:
        """An event set at the next change."""
        return self._changed

    def _set(self, version: int) -> None:
        self._version = version
        event, self._changed = self._changed, asyncio.Event()
        event.set()
