"""A small arithmetic dataset, generated deterministically.

Questions are two- or three-number additions and multiplications
("What is 7 * 3 + 12?") with their integer answers, in JSONL rows
`{"question": ..., "answer": "33"}`. The same seed and sizes always give the
same files; training and validation questions are disjoint, so validation
measures generalisation rather than memory. Files are written atomically, so
a run killed mid-generation never reads half a file.

    python -m services.controller.launcher.dataset OUT_DIR --train-size 512 --validation-size 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path


def question(rng: random.Random, max_operand: int, operations: Sequence[str], terms: Sequence[int]) -> tuple[str, int]:
    count = rng.choice(list(terms))
    numbers = [rng.randint(1, max_operand) for _ in range(count)]
    ops = [rng.choice(list(operations)) for _ in range(count - 1)]
    expression = str(numbers[0])
    for op, n in zip(ops, numbers[1:]):
        expression += f" {op} {n}"
    return f"What is {expression}?", evaluate(expression)


def evaluate(expression: str) -> int:
    """Value of "a op b [op c]" with + and *, multiplication first (the usual precedence)."""
    total = 0
    for term in expression.split("+"):
        product = 1
        for factor in term.split("*"):
            product *= int(factor)
        total += product
    return total


def generate(
    train_size: int, validation_size: int, *, seed: int = 0, max_operand: int = 20,
    operations: Sequence[str] = ("+", "*"), terms: Sequence[int] = (2, 3),
) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows): distinct questions, validation disjoint from train."""
    rng = random.Random(f"arithmetic:{seed}")
    seen: set[str] = set()
    rows: list[dict] = []
    wanted = train_size + validation_size
    attempts = 0
    while len(rows) < wanted:
        attempts += 1
        if attempts > 100 * wanted:
            raise ValueError(f"cannot draw {wanted} distinct questions; raise max_operand or add terms")
        text, answer = question(rng, max_operand, operations, terms)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"question": text, "answer": str(answer)})
    # Validation first: growing train_size later leaves the held-out set unchanged.
    return rows[validation_size:], rows[:validation_size]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def write_dataset(train_path: Path, validation_path: Path, train_size: int, validation_size: int, **kwargs) -> None:
    """Writes both files unless both exist already (they are a pure function of the arguments)."""
    if train_path.exists() and validation_path.exists():
        return
    train, validation = generate(train_size, validation_size, **kwargs)
    _write_jsonl(validation_path, validation)
    _write_jsonl(train_path, train)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--validation-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=20)
    args = parser.parse_args(argv)
    write_dataset(
        args.out_dir / "train.jsonl", args.out_dir / "validation.jsonl", args.train_size, args.validation_size,
        seed=args.seed, max_operand=args.max_operand,
    )
    print(f"wrote {args.out_dir}/train.jsonl and validation.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
