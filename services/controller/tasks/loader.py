"""Data loaders: tasks from JSONL, Parquet, in-memory lists or HF datasets.

`DataLoader` hands out `Task`s: shuffled per epoch with a seed (the order of
epoch e is a pure function of seed and e, so a resumed run sees the same
order), for a number of epochs. Its cursor is part of the checkpoint:
`state_dict()` records where it is *and* which tasks were handed out but not
finished (in flight, pooled or waiting in a batch), so that after a resume
those are served again first: nothing taken is ever lost. `put_back(task)`
puts a task at the front (a rollout that was aborted is retried next).

A validation loader is the same class with `shuffle=False, epochs=1`, read
with `reset()` before each validation.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flywheel.errors import InvalidArgument
from services.controller.domain import Task


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with Path(path).open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{path}:{number}: not valid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise InvalidArgument(f"{path}:{number}: each line must be a JSON object")
            rows.append(row)
    return rows


def read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # optional dependency: only Parquet users need it
        raise InvalidArgument(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    return pq.read_table(path).to_pylist()


def read_hf(name: str, split: str) -> Sequence[Mapping[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise InvalidArgument(f"dataset {name}: Hugging Face datasets need `pip install datasets`") from None
    return datasets.load_dataset(name, split=split)


def rows_from(source: Any) -> Sequence[Mapping[str, Any]]:
    """Rows of a source: a path (.jsonl/.json/.parquet), a list of dicts, or an HF Dataset."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise InvalidArgument(f"data file {path} does not exist")
        if path.suffix in (".jsonl", ".json"):
            return read_jsonl(path)
        if path.suffix == ".parquet":
            return read_parquet(path)
        raise InvalidArgument(f"data file {path}: unknown format (use .jsonl or .parquet)")
    # HF datasets.Dataset and plain lists both index and have a length.
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        return source
    raise InvalidArgument(f"cannot read tasks from a {type(source).__name__}")


class DataLoader:
    """Seeded, epoch-aware, resumable source of tasks."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        shuffle: bool = True,
        seed: int = 0,
        epochs: int = 1,
        split: str = "train",
        limit: int | None = None,
    ) -> None:
        self._rows = rows
        self._size = min(len(rows), limit) if limit else len(rows)
        if self._size == 0:
            raise InvalidArgument(f"{split} data: no rows")
        first = rows[0]
        if prompt_key not in first:
            raise InvalidArgument(f"{split} data: rows have no field {prompt_key!r} (fields: {sorted(first)})")
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.shuffle, self.seed, self.epochs, self.split = shuffle, seed, epochs, split
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)
        self._front: deque[Task] = deque()
        #: Tasks handed out and not yet finished, by id.
        self._outstanding: dict[str, Task] = {}

    def __len__(self) -> int:
        return self._size

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self._size))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _task(self, index: int, epoch: int) -> Task:
        row = self._rows[index]
        return Task(
            id=f"{self.split}:{epoch}:{index}",
            index=index,
            epoch=epoch,
            prompt=row[self.prompt_key],
            answer=row.get(self.answer_key) if self.answer_key else None,
            data=dict(row),
            split=self.split,
        )

    # -- serving ---------------------------------------------------------
    def next(self) -> Task | None:
        """The next task (put-back ones first); None when every epoch is served."""
        if self._front:
            task = self._front.popleft()
        else:
            if self._position >= self._size:
                if self._epoch + 1 >= self.epochs:
                    return None
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
            task = self._task(self._order[self._position], self._epoch)
            self._position += 1
        self._outstanding[task.id] = task
        return task

    def put_back(self, task: Task) -> None:
        """Serves `task` again before any other (an aborted rollout is retried)."""
        self._outstanding.pop(task.id, None)
        self._front.appendleft(task)

    def finish(self, task_id: str) -> None:
        """The task is done for good (trained, or failed): no resume serves it again."""
        self._outstanding.pop(task_id, None)

    def has_more(self) -> bool:
        """Whether next() would return a task now."""
        return bool(self._front) or self._position < self._size or self._epoch + 1 < self.epochs

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    @property
    def epoch(self) -> int:
        return self._epoch

    def reset(self) -> None:
        """Back to the start of epoch 0 (validation loaders, before each pass)."""
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)
        self._front.clear()
        self._outstanding.clear()

    # -- checkpointing ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Outstanding tasks were taken but never trained: serve them first on resume.
        pending = [*self._front, *self._outstanding.values()]
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "size": self._size,
            "pending": [[t.index, t.epoch] for t in pending],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("size") != self._size or state.get("seed") != self.seed:
            raise InvalidArgument(
                f"{self.split} data: checkpointed cursor is for {state.get('size')} rows with seed "
                f"{state.get('seed')}, this loader has {self._size} rows with seed {self.seed}"
            )
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self._epoch)
        self._outstanding.clear()
        self._front = deque(self._task(index, epoch) for index, epoch in state.get("pending", []))


def loader_from_config(cfg: Any, *, seed: int, epochs: int, split: str) -> DataLoader:
    """A DataLoader from a `run_config.LoaderConfig`."""
    if cfg.path is not None and not Path(cfg.path).exists():
        raise InvalidArgument(f"{split} data: file {cfg.path} does not exist")
    if cfg.items is not None:
        rows: Sequence[Mapping[str, Any]] = cfg.items
    elif cfg.hf_name is not None:
        rows = read_hf(cfg.hf_name, cfg.hf_split)
    elif cfg.format == "parquet":
        rows = read_parquet(cfg.path)
    elif cfg.format == "jsonl":
        rows = read_jsonl(cfg.path)
    else:
        rows = rows_from(cfg.path)
    return DataLoader(
        rows,
        prompt_key=cfg.prompt_key,
        answer_key=cfg.answer_key,
        shuffle=cfg.shuffle,
        seed=seed,
        epochs=epochs,
        split=split,
        limit=cfg.limit,
    )
