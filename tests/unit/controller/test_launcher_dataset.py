"""The arithmetic dataset: deterministic, correct answers, disjoint splits."""

from __future__ import annotations

import json

import pytest

from services.controller.launcher.dataset import generate, write_dataset


def test_same_seed_same_rows_and_different_seed_different_rows():
    assert generate(50, 10, seed=3) == generate(50, 10, seed=3)
    assert generate(50, 10, seed=3) != generate(50, 10, seed=4)


def test_answers_are_the_values_of_the_expressions_with_usual_precedence():
    train, validation = generate(200, 20, seed=0)
    for row in train + validation:
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        assert set(expression) <= set("0123456789+* ")
        assert int(row["answer"]) == eval(expression)
    assert any("*" in r["question"] and "+" in r["question"] for r in train)  # precedence matters somewhere
    assert {len(r["question"].split()) for r in train} == {5, 7}  # "What is" + two or three numbers


def test_splits_are_disjoint_and_validation_does_not_change_with_train_size():
    train, validation = generate(100, 30, seed=1)
    assert len(train) == 100 and len(validation) == 30
    assert not {r["question"] for r in train} & {r["question"] for r in validation}
    assert generate(200, 30, seed=1)[1] == validation


def test_too_many_questions_for_the_operand_range_is_an_error():
    with pytest.raises(ValueError, match="distinct"):
        generate(500, 0, max_operand=3, operations=["+"], terms=[2])


def test_write_dataset_writes_jsonl_once(tmp_path):
    train, val = tmp_path / "d" / "train.jsonl", tmp_path / "d" / "validation.jsonl"
    write_dataset(train, val, 20, 5, seed=0)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 20 and set(rows[0]) == {"question", "answer"}
    train.write_text("kept\n")  # present files are not regenerated
    write_dataset(train, val, 20, 5, seed=0)
    assert train.read_text() == "kept\n"
