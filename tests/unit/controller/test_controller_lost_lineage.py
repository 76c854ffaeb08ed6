"""The processor never trains a sample made by weights the run no longer has: a version newer
than the one its batch trains against can only come from a lineage lost with a trainer (the
run was rewound to a checkpoint). Such a group is dropped and its task generated again."""

from __future__ import annotations

import asyncio

from services.controller.domain import Task, Trajectory
from services.controller.batches.processor import AlgorithmProcessor, TrainBatchPool
from services.controller.batches.staleness import StalenessGate


class Groups:
    def __init__(self, groups: list[list[Trajectory]]) -> None:
        self.groups = list(groups)

    async def get_group(self) -> list[Trajectory] | None:
        return self.groups.pop(0) if self.groups else None


def group(task: Task, version_start: int, version_end: int, turns: list[tuple[int, int]] | None = None):
    return [Trajectory(task=task, prompt_ids=[1, 2], response_ids=[3, 4], response_logprobs=[-0.1, -0.2],
                       response_mask=[1, 1], version_start=version_start, version_end=version_end,
                       turn_versions=turns or [], reward=float(i), sample_index=i) for i in range(2)]


def test_a_group_made_by_a_version_newer_than_its_batch_is_dropped_and_generated_again() -> None:
    tasks = [Task(f"train:0:{i}", i, 0, f"question {i}") for i in range(4)]
    gate = StalenessGate(batch_size=2, limit=None, base_version=2)  # resumed (rewound) at version 2
    gate.pending = 8
    out = TrainBatchPool(maxsize=4)
    requeued: list[str] = []
    processor = AlgorithmProcessor(
        Groups([group(tasks[0], 3, 3), group(tasks[1], 2, 2), group(tasks[2], 2, 3, [(2, 2), (2, 4)]),
                group(tasks[3], 3, 3)]),
        lambda g: None, gate, out, batch_size=2, group_size=2, staleness_limit=None,
        requeue=lambda task: requeued.append(task.id), finish=lambda task_id: None,
    )
    asyncio.run(processor.run())
    # Version 3 is newer than batch 1's version 2 (lost lineage); the batch after trains against 3.
    assert requeued == ["train:0:0", "train:0:2"]
    assert processor.dropped["lost weights"] == 2
    trained = [t.task.id for batch in iter(out.get_nowait, None) for t in batch.trajectories]
    assert trained == ["train:0:1", "train:0:1", "train:0:3", "train:0:3"]
