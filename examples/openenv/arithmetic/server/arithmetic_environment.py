"""An OpenEnv environment as an author builds one (`openenv init`'s layout): arithmetic questions, the
quickstart's task, played in a session. reset(seed) asks "What is a + b?" or "a * b" (operands 1-20,
drawn from the seed), or reset(question=...) asks that question (a data set's, so that held-out
questions stay held out); each step grades the reply (reward 1 if its final answer is right, else 0). A wrong
answer gets "Not quite. Try again." while attempts are left (ARITHMETIC_ATTEMPTS, default 1: one answer
an episode, as the quickstart). Its metadata's `accuracy` says whether the episode ended right."""

import os
import random
import re
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import ArithmeticAction, ArithmeticObservation
except ImportError:
    from models import ArithmeticAction, ArithmeticObservation

QUESTION = re.compile(r"What is (\d+) ([+*]) (\d+)\?")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> Optional[float]:
    """The last \\boxed{} in `text`, else its last number; None when it has neither."""
    boxed = BOXED.findall(text)
    numbers = NUMBER.findall(boxed[-1] if boxed else text)
    return float(numbers[-1]) if numbers else None


class ArithmeticEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True  # each session has an instance of its own

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._answer = 0
        self._attempts_left = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, question: Optional[str] = None,
              **kwargs: Any) -> ArithmeticObservation:
        asked = QUESTION.fullmatch(question.strip()) if question else None
        if question and asked is None:
            raise ValueError(f"not a question of this environment: {question!r} (\"What is <a> <+ or *> <b>?\")")
        if asked:
            a, op, b = int(asked.group(1)), asked.group(2), int(asked.group(3))
        else:
            rng = random.Random(seed)
            a, b, op = rng.randint(1, 20), rng.randint(1, 20), rng.choice("+*")
        self._answer = a + b if op == "+" else a * b
        self._attempts_left = int(os.environ.get("ARITHMETIC_ATTEMPTS", "1"))
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return ArithmeticObservation(prompt=f"What is {a} {op} {b}?", done=False, reward=None)

    def step(self, action: ArithmeticAction) -> ArithmeticObservation:  # type: ignore[override]
        self._state.step_count += 1
        self._attempts_left -= 1
        right = final_answer(action.message) == self._answer
        done = right or self._attempts_left <= 0
        prompt = "Correct." if right else "Not quite. Try again." if not done else f"The answer was {self._answer}."
        return ArithmeticObservation(prompt=prompt, done=done, reward=1.0 if right else 0.0,
                                     metadata={"accuracy": float(right), "attempt": self._state.step_count})

    @property
    def state(self) -> State:
        return self._state
