"""`SingleTurnMathWorker`: a question with a reference answer -> completions
-> reward by checking the final answer.

The question is sent with an instruction to put the final answer in
`\\boxed{}` (`worker.instruction` replaces it; '' sends the bare question);
the default reward ("math") takes the last `\\boxed{...}` of the completion,
else its last number, and compares it with the task's answer
(GSM8K's "#### 42" form included). Tasks without an answer fail with that
error recorded instead of scoring 0 silently.
"""

from __future__ import annotations

from services.controller.domain import RolloutOutcome, RolloutStatus, SamplingSpec, Task
from services.controller.workers.simple import SimpleRolloutWorker

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class SingleTurnMathWorker(SimpleRolloutWorker):
    instruction: str = INSTRUCTION

    def format_prompt(self, task: Task) -> str:
        question = str(task.prompt).rstrip()
        instruction = self.instruction if self.ctx.instruction is None else self.ctx.instruction
        return f"{question}\n{instruction}" if instruction else question

    async def rollout(self, task: Task, n: int, sampling: SamplingSpec) -> RolloutOutcome:
        if task.answer is None:
            return RolloutOutcome(RolloutStatus.FAIL, error=f"task {task.id} has no reference answer")
        return await super().rollout(task, n, sampling)
