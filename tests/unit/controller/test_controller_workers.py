"""Rollout workers (simple, math, agent with tools) and replica balancing."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field

import pytest

from flywheel.errors import Unavailable
from services.controller.rollouts.balancer import EnginePool
from services.controller.domain import (
    FinishReason,
    Generation,
    PromptInput,
    RolloutStatus,
    SamplingSpec,
    Task,
    TrajectoryStatus,
)
from services.controller.loop import run
from services.controller.tasks.rewards import get_reward
from services.controller.testing.simulated import SimulatedRolloutEngine, run_virtual
from services.controller.workers import (
    AgentRolloutWorker,
    SimpleRolloutWorker,
    SingleTurnMathWorker,
    WorkerContext,
    worker_class,
)
from services.controller.workers.tools import ToolRegistry, parse_tool_calls
from tests.unit.controller.controller_helpers import config, simulated_pipeline, task


@dataclass
class ScriptedEngine:
    """Answers each generate call with the next scripted text; records prompts."""

    name: str
    replies: list[str]
    version: int = 2
    prompts: list[PromptInput] = field(default_factory=list)
    finish: FinishReason = FinishReason.STOP
    fail_with: Exception | None = None
    calls: int = 0

    async def generate(self, prompts, sampling):
        self.calls += 1
        if self.fail_with is not None:
            raise self.fail_with
        self.prompts.extend(prompts)
        out = []
        for _ in prompts:
            group = []
            for _ in range(sampling.n):
                text = self.replies.pop(0) if self.replies else "done"
                ids = [100 + len(text) % 50, 101, 102]
                group.append(Generation([1, 2], ids, [-0.1, -0.2, -0.3], self.finish, self.version, self.version, text))
            out.append(group)
        return out

    async def tokenize(self, *, text=None, messages=None, add_generation_prompt=True):
        if text is not None:
            return [900 + i for i in range(len(text.split()))]
        return [1, 2, 3, 4]


def ctx(*engines, reward="math", **kw) -> WorkerContext:
    return WorkerContext(engines=EnginePool(list(engines)), reward=get_reward(reward), **kw)


async def test_math_worker_scores_final_answers() -> None:
    engine = ScriptedEngine("e", ["so \\boxed{3}", "I get 4", "\\boxed{4}", "no idea"])
    worker = SingleTurnMathWorker(ctx(engine))
    outcome = await worker.rollout(task(answer="#### 4"), 4, SamplingSpec())
    assert outcome.status == RolloutStatus.SUCCESS
    assert [t.reward for t in outcome.trajectories] == [0.0, 1.0, 1.0, 0.0]
    assert [t.sample_index for t in outcome.trajectories] == [0, 1, 2, 3]
    t = outcome.trajectories[0]
    assert t.response_mask == [1, 1, 1] and t.response_logprobs == [-0.1, -0.2, -0.3] and t.version == 2
    assert "\\boxed{}" in engine.prompts[0].messages[-1]["content"]  # the instruction was added
    no_answer = await worker.rollout(task(answer=None), 2, SamplingSpec())
    assert no_answer.status == RolloutStatus.FAIL and "no reference answer" in no_answer.error


async def test_math_worker_instruction_is_configurable() -> None:
    engine = ScriptedEngine("e", ["\\boxed{4}"] * 2)
    await SingleTurnMathWorker(ctx(engine, instruction="Answer briefly.")).rollout(task(answer="4"), 1, SamplingSpec())
    await SingleTurnMathWorker(ctx(engine, instruction="")).rollout(task(answer="4"), 1, SamplingSpec())
    replaced, bare = (p.messages[-1]["content"] for p in engine.prompts)
    assert replaced.endswith("\nAnswer briefly.") and "boxed" not in replaced
    assert bare == str(task(answer="4").prompt).rstrip()


async def test_simple_worker_sends_text_or_chat_and_keeps_system_prompt() -> None:
    engine = ScriptedEngine("e", ["hello"])
    worker = SimpleRolloutWorker(ctx(engine, reward="length", chat=True, system_prompt="Be brief."))
    await worker.rollout(task(), 1, SamplingSpec())
    assert [m["role"] for m in engine.prompts[0].messages] == ["system", "user"]
    raw = SimpleRolloutWorker(ctx(engine, reward="length", chat=False))
    await raw.rollout(task(), 1, SamplingSpec())
    assert engine.prompts[1].text == "question 0" and engine.prompts[1].messages is None


async def test_a_raising_reward_fails_the_trajectory_not_the_run() -> None:
    def flaky(t, completion):
        if "bad" in completion:
            raise KeyError("missing field")
        return 1.0

    worker = SimpleRolloutWorker(WorkerContext(engines=EnginePool([ScriptedEngine("e", ["good", "bad"])]), reward=flaky))
    outcome = await worker.rollout(task(), 2, SamplingSpec())
    assert outcome.status == RolloutStatus.FAIL
    assert outcome.trajectories[0].status == TrajectoryStatus.OK
    assert outcome.trajectories[1].status == TrajectoryStatus.FAILED
    assert "KeyError" in outcome.trajectories[1].error and "sample 1" in outcome.error


def test_reward_errors_are_recorded_and_the_run_goes_on() -> None:
    calls = {"n": 0}

    def sometimes_raises(t, completion):
        calls["n"] += 1
        if t.index % 5 == 0:
            raise RuntimeError(f"reward crashed on {t.id}")
        return float(len(completion) % 2)

    import services.controller.tasks.rewards as rewards

    rewards.register_reward("test_sometimes_raises")(sometimes_raises)
    cfg = config(reward={"name": "test_sometimes_raises"}, run={"max_steps": 4})
    p, _, _ = simulated_pipeline(cfg)
    summary = run_virtual(run(p))
    assert summary.steps == 4
    record = p.errors.records[0]
    assert record.module == "rollout_worker" and record.severity == "error"
    assert "reward crashed" in record.message and record.context["task"].endswith(("0", "5"))


async def test_aborted_or_unreachable_generation_asks_for_a_re_rollout() -> None:
    aborted = ScriptedEngine("e", ["x"], finish=FinishReason.ABORT)
    assert (await SimpleRolloutWorker(ctx(aborted)).rollout(task(), 1, SamplingSpec())).status == RolloutStatus.RE_ROLLOUT
    down = ScriptedEngine("e", [], fail_with=Unavailable("connection refused"))
    outcome = await SimpleRolloutWorker(ctx(down)).rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.RE_ROLLOUT and "no healthy rollout replica" in outcome.error


async def test_balancer_routes_to_the_least_loaded_and_fails_over() -> None:
    slow = SimulatedRolloutEngine(name="a")
    fast = SimulatedRolloutEngine(name="b")
    pool = EnginePool([slow, fast])
    first = asyncio.ensure_future(pool.generate([PromptInput("1", text="x")], SamplingSpec()))
    await asyncio.sleep(0)
    second = await pool.generate([PromptInput("2", text="y")], SamplingSpec())
    assert (await first)[0][0].engine != second[0][0].engine  # spread over both replicas

    slow.down = True  # a replica dies: its requests go to the other one
    names = {(await pool.generate([PromptInput(str(i), text="z")], SamplingSpec()))[0][0].engine for i in range(4)}
    assert names == {"b"} and not pool.replica("a").healthy
    assert pool.min_version() == 0
    pool.mark("a", True)
    assert pool.replica("a").healthy
    fast.down = slow.down = True
    with pytest.raises(Unavailable, match="no healthy rollout replica of 2"):
        await pool.generate([PromptInput("3", text="w")], SamplingSpec())


async def test_sticky_routing_keeps_an_episode_on_one_replica() -> None:
    pool = EnginePool([SimulatedRolloutEngine(name=n) for n in "abc"])
    engines = {(await pool.generate([PromptInput("p", text="x")], SamplingSpec(), sticky="ep-7"))[0][0].engine for _ in range(5)}
    assert len(engines) == 1


async def add(a: int, b: int) -> int:
    return a + b


def lookup(key: str) -> dict:
    return {"key": key, "value": len(key)}


def tools() -> ToolRegistry:
    registry = ToolRegistry()
    registry.register("add", add, "adds two integers")
    registry.register("lookup", lookup, "looks a key up")
    return registry


async def test_agent_runs_tools_and_masks_their_tokens_out_of_the_loss() -> None:
    replies = [
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> <tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"abc\\"}"}</tool_call>',
        "The answer is \\boxed{5}",
    ]
    engine = ScriptedEngine("e", replies)
    worker = AgentRolloutWorker(ctx(engine, tools=tools(), tool_result_template="[tool] {result} [/tool] "))
    outcome = await worker.rollout(task(answer="5"), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.SUCCESS
    t = outcome.trajectories[0]
    assert t.reward == 1.0 and t.keys["turns"] == 3
    # 3 generated turns of 3 tokens (mask 1) with tool results in between (mask 0).
    runs = [(m, len(list(g))) for m, g in itertools.groupby(t.response_mask)]
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1] and runs[0][1] == runs[2][1] == runs[4][1] == 3
    assert runs[1][1] == 3  # "[tool] 5 [/tool]": 3 tokens from the engine's tokenizer
    assert len(t.response_ids) == len(t.response_logprobs) == len(t.response_mask)
    assert all(lp == 0.0 for lp, m in zip(t.response_logprobs, t.response_mask) if m == 0)
    assert "[tool] 5 [/tool]" in t.text and "unknown tool 'nope'" in t.text and '"value": 3' in t.text
    # Turns after the first continue from token ids: prompt + everything so far.
    second = engine.prompts[1].token_ids
    assert second[:4] == [1, 2, 3, 4] and second[4:] == t.response_ids[:6]
    assert "adds two integers" in json.dumps(worker.messages_for(task()))


async def test_agent_stops_after_max_turns_and_on_abort() -> None:
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    engine = ScriptedEngine("e", [call] * 10)
    worker = AgentRolloutWorker(ctx(engine, tools=tools(), max_turns=2, reward="length"))
    outcome = await worker.rollout(task(), 2, SamplingSpec())
    assert [t.keys["turns"] for t in outcome.trajectories] == [2, 2] and engine.calls == 4
    aborted = ScriptedEngine("e", [call], finish=FinishReason.ABORT)
    worker = AgentRolloutWorker(ctx(aborted, tools=tools(), reward="length"))
    assert (await worker.rollout(task(), 2, SamplingSpec())).status == RolloutStatus.RE_ROLLOUT


async def test_tool_errors_become_results_the_model_sees() -> None:
    def boom(**kw):
        raise ValueError("bad input")

    registry = ToolRegistry(timeout_seconds=0.05)
    registry.register("boom", boom)

    async def hang():
        await asyncio.sleep(10)

    registry.register("hang", hang)
    calls = parse_tool_calls('<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call><tool_call>not json</tool_call>'
                             '<tool_call>{"name": "hang"}</tool_call><tool_call>{"arguments": {}}</tool_call>')
    results = [await registry.call(c) for c in calls]
    assert results[0] == "error: ValueError: bad input"
    assert results[1].startswith("error: tool call is not valid JSON")
    assert "timed out" in results[2] and "needs" in results[3]


def test_worker_classes_by_name_or_import_path() -> None:
    assert worker_class("agent") is AgentRolloutWorker
    assert worker_class("services.controller.workers.math:SingleTurnMathWorker") is SingleTurnMathWorker
    with pytest.raises(ValueError, match="not a RolloutWorker"):
        worker_class("services.controller.domain:Task")
    assert Task  # imported for the check above
