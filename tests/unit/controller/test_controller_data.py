"""Data loaders: formats, seeded shuffling, epochs, put-back, the resumable cursor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.errors import InvalidArgument
from services.controller.tasks.loader import DataLoader, loader_from_config, rows_from
from services.controller.run_config import LoaderConfig

ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]


def drain(loader: DataLoader) -> list[str]:
    out = []
    while (t := loader.next()) is not None:
        out.append(t.id)
    return out


def test_jsonl_parquet_list_and_dataset_objects_give_the_same_tasks(tmp_path: Path) -> None:
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")

    class FakeHFDataset:  # what `datasets.Dataset` offers: len and integer indexing
        def __len__(self) -> int:
            return len(ROWS)

        def __getitem__(self, i: int) -> dict:
            return ROWS[i]

    sources = [rows_from(jsonl), ROWS, FakeHFDataset()]
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    sources.append(rows_from(parquet))
    orders = []
    for rows in sources:
        loader = DataLoader(rows, seed=7)
        tasks = []
        while (t := loader.next()) is not None:
            tasks.append((t.id, t.prompt, t.answer))
        orders.append(tasks)
    assert all(o == orders[0] for o in orders)
    assert sorted(p for _, p, _ in orders[0]) == sorted(r["prompt"] for r in ROWS)


def test_loader_from_config_reads_each_format(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"question": r["prompt"], "gold": r["answer"]}) for r in ROWS))
    loader = loader_from_config(
        LoaderConfig(path=path, prompt_key="question", answer_key="gold", shuffle=False, limit=3),
        seed=0, epochs=1, split="train",
    )
    tasks = [loader.next() for _ in range(3)]
    assert [t.prompt for t in tasks] == ["q0", "q1", "q2"] and tasks[2].answer == "2"
    assert loader.next() is None  # limit 3


def test_bad_files_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(InvalidArgument, match="bad.jsonl:2: not valid JSON"):
        rows_from(bad)
    with pytest.raises(InvalidArgument, match="does not exist"):
        rows_from(tmp_path / "missing.jsonl")
    with pytest.raises(InvalidArgument, match="no field 'prompt'"):
        DataLoader([{"question": "x"}])


def test_shuffling_is_seeded_per_epoch_and_epochs_cover_every_row() -> None:
    a, b = DataLoader(ROWS, seed=1, epochs=2), DataLoader(ROWS, seed=1, epochs=2)
    ids = drain(a)
    assert ids == drain(b)  # same seed, same order
    assert ids != drain(DataLoader(ROWS, seed=2, epochs=2))
    first, second = ids[:10], ids[10:]
    assert {i.split(":")[2] for i in first} == {i.split(":")[2] for i in second} == {str(i) for i in range(10)}
    assert [i.split(":")[2] for i in first] != [i.split(":")[2] for i in second]  # a fresh order per epoch
    assert not a.has_more()


def test_put_back_serves_the_task_again_first() -> None:
    loader = DataLoader(ROWS, shuffle=False)
    t0, t1 = loader.next(), loader.next()
    loader.put_back(t0)
    assert loader.next() == t0
    assert loader.next().index == 2
    assert t1 is not None


def test_cursor_resume_serves_unfinished_tasks_first_and_loses_nothing() -> None:
    loader = DataLoader(ROWS, seed=5, epochs=2)
    taken = [loader.next() for _ in range(6)]
    for t in taken[:3]:
        loader.finish(t.id)  # trained
    loader.put_back(taken[3])  # an aborted rollout
    state = json.loads(json.dumps(loader.state_dict()))  # travels as checkpoint bytes

    resumed = DataLoader(ROWS, seed=5, epochs=2)
    resumed.load_state_dict(state)
    rest = drain(resumed)
    assert set(rest[:3]) == {t.id for t in taken[3:]}  # the unfinished ones come first
    trained = {t.id for t in taken[:3]}
    assert not trained & set(rest)  # nothing trained twice
    assert len(trained) + len(rest) == 20  # nothing lost over two epochs

    with pytest.raises(InvalidArgument, match="checkpointed cursor"):
        DataLoader(ROWS[:5], seed=5).load_state_dict(state)


def test_validation_loader_resets_to_the_same_order() -> None:
    loader = DataLoader(ROWS, shuffle=False, split="val")
    first = drain(loader)
    loader.reset()
    assert drain(loader) == first and first[0] == "val:0:0"
