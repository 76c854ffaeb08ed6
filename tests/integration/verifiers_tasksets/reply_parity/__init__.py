"""A verifiers taskset for tests/integration/test_verifiers.py: any question, and a reward a random model
earns half the time, computed from the reply alone, so the test can recompute it from what the session
recorded: 1 when the reply has an even number of characters. Its metric `reply_chars` is that number."""

import verifiers.v1 as vf


class ParityTask(vf.Task[vf.TaskData]):
    @vf.stop
    async def one_reply(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def even(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or "") % 2 == 0)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class ParityTaskset(vf.Taskset[ParityTask, vf.TasksetConfig]):
    def load(self) -> list[ParityTask]:
        return [ParityTask(vf.TaskData(idx=0, prompt="Say something."), self.config.task)]


__all__ = ["ParityTaskset"]
