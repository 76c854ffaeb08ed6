"""The external-agent integration test's agent and worker, loaded by the controller by name.

`run` is an agent as a user writes it, with the `openai` SDK only: three
chat turns, each sending the conversation back unchanged plus a new user
message, a pause between turns (EXTERNAL_AGENT_PAUSE seconds) so that weights
can move mid-episode, and an exception for every fourth task (after its
first call) so that the run meets agents that raise.

`RecordingWorker` is the external worker, writing each episode's session
records and the trajectory it returned to EXTERNAL_AGENT_RECORDS (JSONL), for
the test to compare with what was trained.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import asdict

from openai import AsyncOpenAI

from services.controller.workers.external import ExternalAgentWorker
from services.controller.workers.verifiers import VerifiersWorker


def raises(task: dict) -> bool:
    return int(task["id"].rsplit(":", 1)[-1]) % 4 == 3


async def run(task: dict, base_url: str, api_key: str) -> float:
    pause = float(os.environ.get("EXTERNAL_AGENT_PAUSE", "0"))
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        messages: list = [{"role": "user", "content": task["prompt"]}]
        for turn in range(3):
            if turn:
                messages.append({"role": "user", "content": "Are you sure? Say it again."})
                await asyncio.sleep(pause)
            response = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0)
            message = response.choices[0].message
            messages.append(message)
            if raises(task):
                raise RuntimeError(f"the agent broke on {task['id']}")
    return float(len(message.content or "") % 2)


class Recording:
    """Writes each episode's session records beside the trajectory trained from them (EXTERNAL_AGENT_RECORDS)."""

    async def _run(self, task, index, sessions, session, replica, sampling=None):
        outcome = await super()._run(task, index, sessions, session, replica, sampling)
        try:
            calls = [asdict(c) for c in (await sessions.read(session.id)).calls]
        except Exception as exc:  # a lost session: nothing to compare
            calls = [{"error": str(exc)}]
        row = {"task": task.id, "sample": index, "status": outcome.status.value, "error": outcome.error,
               "calls": calls, "trajectory": None}
        if outcome.trajectories:
            t = outcome.trajectories[0]
            row["trajectory"] = {"prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
                                 "response_logprobs": t.response_logprobs, "response_mask": t.response_mask,
                                 "turn_versions": t.turn_versions, "reward": t.reward, "scores": t.scores}
        with open(os.environ["EXTERNAL_AGENT_RECORDS"], "a") as out:
            out.write(json.dumps(row, default=list) + "\n")
        return outcome


class RecordingWorker(Recording, ExternalAgentWorker):
    pass


class RecordingVerifiersWorker(Recording, VerifiersWorker):
    pass
