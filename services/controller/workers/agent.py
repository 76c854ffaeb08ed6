"""`AgentRolloutWorker`: multi-turn chat with tool calls.

An episode works on token ids from the start, so what is trained is exactly
what was sampled (re-tokenizing text would shift tokens and break RL):

1. the chat prompt (system message listing the tools, then the task) is
   tokenized once by the engine's chat template;
2. each turn generates from prompt + everything so far, as token ids; the
   completion's tokens join the response with mask 1 and their log-probs;
3. if the turn calls tools, the worker runs them (the user's registered
   functions), renders the results with `tool_result_template` and appends
   their tokens with mask 0: tool and environment tokens never enter the
   loss;
4. it stops when a turn calls no tool, is cut by max_tokens, or after
   `max_turns` turns.

The reward sees the whole episode's text. All turns of one episode go to the
same replica (sticky routing) so its prefix cache is reused; the group's
`n` episodes run concurrently.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from services.controller.domain import (
    FinishReason,
    PromptInput,
    RolloutOutcome,
    RolloutStatus,
    SamplingSpec,
    Task,
    Trajectory,
)
from services.controller.workers.base import RETRYABLE, RolloutWorker
from services.controller.workers.tools import ToolRegistry, parse_tool_calls
from services.controller.workers.transcript import EpisodeStopped, Transcript

#: ChatML, the format of Qwen and SmolLM2 chat templates; the completion
#: before it ended with the end-of-turn token.
DEFAULT_TOOL_RESULT_TEMPLATE = "\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"


class AgentRolloutWorker(RolloutWorker):
    @property
    def tools(self) -> ToolRegistry:
        return self.ctx.tools

    def messages_for(self, task: Task) -> list[dict]:
        messages = super().messages_for(task)
        tool_prompt = self.tools.system_prompt()
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{tool_prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": tool_prompt})
        return messages

    async def rollout(self, task: Task, n: int, sampling: SamplingSpec) -> RolloutOutcome:
        try:
            trajectories = await asyncio.gather(*(self.episode(task, i, sampling) for i in range(n)))
        except EpisodeStopped as stop:
            return stop.outcome
        except RETRYABLE as exc:
            return RolloutOutcome(RolloutStatus.RE_ROLLOUT, error=f"{type(exc).__name__}: {exc}")
        return await self.score_all(task, list(trajectories))

    async def episode(self, task: Task, index: int, sampling: SamplingSpec) -> Trajectory:
        engines, key = self.ctx.engines, f"{task.id}#{index}"
        template = self.ctx.tool_result_template or DEFAULT_TOOL_RESULT_TEMPLATE
        prompt_ids = await engines.tokenize(messages=self.messages_for(task), add_generation_prompt=True, sticky=key)
        episode = Transcript(prompt_ids)
        for turn in range(self.ctx.max_turns):
            request = PromptInput(request_id=f"{key}@{turn}", token_ids=episode.context)
            g = (await engines.generate([request], replace(sampling, n=1), sticky=key))[0][0]
            episode.model_turn(g)
            calls = parse_tool_calls(g.text)
            if not calls or g.finish_reason == FinishReason.LENGTH or turn == self.ctx.max_turns - 1:
                break
            results = [await self.tools.call(c) for c in calls]
            rendered = "".join(template.format(result=r) for r in results)
            episode.world_turn(await engines.tokenize(text=rendered, add_generation_prompt=False, sticky=key), rendered)
        return episode.trajectory(task, index, self.ctx.model_tag)
