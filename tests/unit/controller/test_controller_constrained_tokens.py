"""An agent episode with a forced tool call (a strict JSON schema) trains with its constrained tokens
flagged: the rollout's transformers engine (xgrammar, as vLLM) records each constrained position's
allowed set in the session; the controller rebuilds the episode from the session's records and builds
the TrainBatch; the trainer takes each constrained token's log-prob over that set.

As documented (docs/architecture.md, the sampling contract): a constrained token whose allowed set was
carried has its ratio taken over the same support as the sampler's (1 on the sampling weights), one
whose set was too big to carry (engine.max_kept_ids) is excluded from the loss and counted; without
the sets the trainer would take the forced tokens' log-probs over the whole vocabulary, and their
ratio shows the bias."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import torch

from flywheel.models.tiny import build_tiny_model
from flywheel.runtime.auth import Scope, TokenScopes
from services.controller.adapters.sessions import session_call
from services.controller.batches.batching import build_train_batch
from services.controller.domain import Task
from services.controller.rollouts.episodes import rebuild, trajectory
from services.rollout.config import RolloutConfig
from services.rollout.engine.text import TextCodec
from services.rollout.engine.transformers_engine import TransformersEngine
from services.rollout.openai_api.http_api import create_app
from services.rollout.openai_api.sessions import SessionStore
from services.rollout.serving.core import RolloutCore
from services.trainer.config import TrainerConfig
from services.trainer.loss_request import LossRequest
from services.trainer.training import TrainingEngine

TOKEN = "secret"
ADD = {"type": "function", "function": {
    "name": "add", "description": "adds two integers", "strict": True,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("forced") / "model")


@pytest_asyncio.fixture
async def episode_calls(model: Path):
    """run(max_kept_ids): the session records of one agent turn whose tool call was forced, on a rollout that
    carries allowed sets of up to that many tokens as their ids."""

    async def run(max_kept_ids: int) -> list[dict]:
        codec = TextCodec.load(model)
        engine = TransformersEngine(model, {"dtype": "float32", "max_model_len": 1024, "seed": 0}, codec)
        engine.max_kept_ids = max_kept_ids
        await engine.start()
        try:
            core = RolloutCore(RolloutConfig(), engine=engine, codec=codec, model_name="tiny")
            app = create_app(core, core.config, TokenScopes.of({Scope.OPERATOR: [TOKEN]}),
                             SessionStore(default_ttl_seconds=60, max_open=4), "rollout-a")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rollout") as http:
                opened = (await http.post("/v1/sessions", headers={"authorization": f"Bearer {TOKEN}"}, json={})).json()
                reply = await http.post(f"{opened['base_path']}/chat/completions",
                                        headers={"authorization": f"Bearer {opened['key']}"},
                                        json={"model": "tiny", "messages": [{"role": "user", "content": "2 + 3?"}],
                                              "tools": [ADD], "tool_choice": {"type": "function",
                                                                              "function": {"name": "add"}},
                                              "temperature": 1.0, "max_tokens": 48, "seed": 5})
                assert reply.status_code == 200, reply.text
                record = (await http.get(f"/v1/sessions/{opened['id']}",
                                         headers={"authorization": f"Bearer {TOKEN}"})).json()
        finally:
            await engine.stop()
        return record["calls"]

    return run


def _trained(model: Path, tmp_path: Path, calls: list[dict], *, drop_sets: bool = False):
    generations = [session_call(c) for c in calls]
    if drop_sets:
        for g in generations:
            g.kept_sets = []
    (segment,) = rebuild(generations).segments
    traj = trajectory(segment, Task(id="t", prompt="2 + 3?", index=0, epoch=0), sample_index=0, model_tag="default",
                      engine="rollout-a")
    traj.advantage = 1.0
    batch = build_train_batch([traj], target_version=0)
    engine = TrainingEngine(TrainerConfig.model_validate({"model": {"path": str(model)},
                                                          "checkpoint": {"dir": str(tmp_path / "ckpt")}}))
    engine.load()
    # A training step: the gradients of the constrained tokens are those of their log-probs over the allowed sets.
    out = engine.forward_backward(batch.tensors, LossRequest(kind="importance_sampling"))
    assert engine.optim_step().step == 1
    return traj, batch, out


async def test_a_forced_tool_calls_constrained_tokens_are_flagged_and_their_ratio_taken_over_the_allowed_set(
        model: Path, episode_calls, tmp_path: Path) -> None:
    calls = await episode_calls(max_kept_ids=16)
    sets = calls[0]["kept_sets"]
    assert sets and all(k["constrained"] for k in sets), "every token of a forced call is constrained"
    carried = [k for k in sets if k["token_ids"]]
    assert carried and any(k["size"] == 1 for k in carried), "the call's fixed text is forced one token at a time"
    traj, batch, out = _trained(model, tmp_path, calls)
    p = len(traj.prompt_ids)
    mask = batch.tensors["loss_mask"][0]
    behaviour = batch.tensors["behaviour_logprobs"][0]
    # Carried: the trainer's log-prob is over the grammar's allowed set, as the sampler's was: ratio 1.
    at = torch.tensor([p + k["position"] for k in carried])
    assert torch.allclose(out.logprobs[0, at], behaviour[at], atol=1e-4)
    forced = torch.tensor([p + k["position"] for k in carried if k["size"] == 1])
    assert torch.all(out.logprobs[0, forced].abs() < 1e-5), "a forced token has probability 1 under its grammar"
    # Too big to carry: left out of the loss, and counted.
    too_big = [p + k["position"] for k in sets if not k["token_ids"]]
    assert batch.sampler_counts["constrained_excluded"] == len(too_big)
    assert batch.sampler_counts["constrained"] == len(carried)
    assert all(mask[i] == 0 for i in too_big)
    assert int(mask.sum()) == len(traj.response_ids) - len(too_big)

    # Without the allowed sets the trainer takes the forced tokens over the whole vocabulary: a ratio far below 1.
    _, _, blind = _trained(model, tmp_path, calls, drop_sets=True)
    assert (blind.logprobs[0, forced] - behaviour[forced]).max() < -1.0


async def test_a_rollout_that_carries_no_ids_leaves_every_constrained_token_out(episode_calls) -> None:
    calls = await episode_calls(max_kept_ids=0)
    sets = calls[0]["kept_sets"]
    assert sets and not any(k["token_ids"] for k in sets)
    batch = _built(calls)
    assert batch.sampler_counts["constrained_excluded"] == len(sets)
    # Every policy token of this turn is constrained: nothing of it trains.
    assert float(batch.tensors["loss_mask"].sum()) == 0


def _built(calls: list[dict]):
    generations = [session_call(c) for c in calls]
    (segment,) = rebuild(generations).segments
    traj = trajectory(segment, Task(id="t", prompt="2 + 3?", index=0, epoch=0), sample_index=0, model_tag="default",
                      engine="rollout-a")
    return build_train_batch([traj], target_version=0)
