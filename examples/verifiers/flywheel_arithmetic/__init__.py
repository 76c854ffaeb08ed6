"""A verifiers taskset as an author writes one (verifiers 0.4, `verifiers.v1`): the quickstart's
arithmetic questions, "What is a + b?" or "a * b" with operands 1-20, answered in one turn.

The reward, `accuracy`, is 1 when the reply's final answer (its last \\boxed{}, else its last
number) is the right one. `load()` draws the taskset's own questions (`size` of them from `seed`),
which is what `verifiers_host.py`'s /tasks and verifiers' own `eval` read; a Flywheel run gives
the host its data set's rows instead (`question` as the prompt, `answer`), so held-out questions
stay held out. It imports nothing of Flywheel: it runs in verifiers' virtual environment.
"""

import random
import re

import verifiers.v1 as vf

SYSTEM = "You are a careful calculator. Answer with the final result in \\boxed{}."
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> float | None:
    """The last \\boxed{} in `text`, else its last number; None when it has neither."""
    boxed = BOXED.findall(text)
    numbers = NUMBER.findall(boxed[-1] if boxed else text)
    return float(numbers[-1]) if numbers else None


class ArithmeticData(vf.TaskData):
    answer: str
    """The right result, as text."""
    system_prompt: str | None = SYSTEM


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.stop
    async def one_answer(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def accuracy(self, trace: vf.Trace) -> float:
        return 1.0 if final_answer(trace.last_reply or "") == float(self.data.answer) else 0.0


class ArithmeticConfig(vf.TasksetConfig):
    size: int = 512
    seed: int = 0


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self) -> list[ArithmeticTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.size):
            a, b, op = rng.randint(1, 20), rng.randint(1, 20), rng.choice("+*")
            answer = a + b if op == "+" else a * b
            tasks.append(ArithmeticTask(ArithmeticData(idx=i, prompt=f"What is {a} {op} {b}?", answer=str(answer)),
                                        self.config.task))
        return tasks


__all__ = ["ArithmeticTaskset"]
