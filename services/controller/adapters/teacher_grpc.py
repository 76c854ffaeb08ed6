"""The teacher of on-policy distillation (services/controller/tasks/teacher.py) over gRPC:
the Score RPC of rollout replicas serving the teacher model (`algorithm.teacher.addresses`).

Every call goes to the next address in turn, a retry included: a dead
replica costs a group one attempt, not the group. The deadline of each call is the teacher's (`timeout_seconds`), passed
to the RPC so no call outlives it; transport retries are left to the teacher.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from flywheel.rollout.client import RolloutClient
from services.controller.run_config import TeacherConfig


class GrpcTeacher:
    def __init__(self, config: TeacherConfig, token: str | None = None) -> None:
        self.timeout = config.timeout_seconds
        self.clients = [RolloutClient(address, token=token, timeout=config.timeout_seconds, max_attempts=1)
                        for address in config.addresses]
        self._turn = itertools.count()

    async def score(self, sequences: Sequence[Sequence[int]], attempt: int) -> list[list[float]]:
        client = self.clients[next(self._turn) % len(self.clients)]
        return [list(s.logprobs) for s in await client.score(sequences, timeout=self.timeout)]

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
