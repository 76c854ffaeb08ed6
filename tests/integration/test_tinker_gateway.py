"""The official Tinker SDK (tinker==0.38, unmodified) trains and samples through
the gateway on a real trainer and a real rollout process: sessions,
create_model, forward / forward_backward (protobuf both ways; cross_entropy,
importance_sampling, ppo and cispo with clip thresholds), optim_step with
per-step Adam parameters, the futures protocol, named saves, saves for the
sampler installed on the rollout, sampling on an exact version, and refusals
the SDK surfaces as user errors. Tenants: a tenant key opens the Tinker API
alone (PERMISSION_DENIED on every trainer and synchronizer RPC) and sees
nothing of another tenant's (404, by id and by path); a model the trainer
lost in a restart is refused until a save is loaded into a new one."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from flywheel.runtime.tokens import add_tenant_key
from tests.integration.tinker_gateway_helpers import (  # noqa: F401 - the fixtures among them
    ADAPTED, AGENT_KEY, BOB_KEY, KEY, PROMPT, SERVICE_KEY, fixed_data, gateway_on, lora_trainer,
    lora_trainer_for_sampling, merged_rollout, rollout, untied_model,
)

pytestmark = pytest.mark.slow




def train_with_the_sdk(url: str, base_model: str) -> dict:
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=base_model, rank=4).result()
    info = training.get_info()
    data = fixed_data()
    forward = training.forward(data, "cross_entropy").result()
    losses, first_pass = [], None
    for _ in range(5):
        result = training.forward_backward(data, "cross_entropy").result()
        first_pass = first_pass or result
        losses.append(result.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    saved = training.save_state("after-five", ttl_seconds=3600).result()
    try:
        training.save_state("after-five").result()
        again = None
    except tinker.RequestFailedError as exc:
        again = exc
    rl = rl_datum(training)
    clipped = {loss: training.forward_backward([rl], loss, CLIP_CONFIG).result() for loss in ("ppo", "cispo")}
    refused = []
    for loss, config in (("dro", None), ("ppo", {"clip_low_threshold": 0.9, "kl_coeff": 0.1})):
        try:
            training.forward_backward(data, loss, config).result()
            refused.append(None)
        except tinker.RequestFailedError as exc:
            refused.append(exc)
    service.close("success").result()
    return {"info": info, "forward": forward, "first": first_pass, "losses": losses, "saved": saved,
            "again": again, "rl": rl, "clipped": clipped, "refused": refused, "model_id": training.model_id}


#: ppo's and cispo's thresholds on the ratio p/q, and per target position the ratio to make and the advantage:
#: ratios above, below and inside [0.9, 1.3], advantages of both signs.
CLIP_CONFIG = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}
RATIOS = [1.5, 0.5, 1.1, 1.5, 0.5, 1.0]
ADVANTAGES = [1.0, 2.0, 0.5, -1.0, -1.0, 0.0]
RL_TOKENS = [11, 42, 77, 23, 56, 9]


def rl_datum(training: tinker.TrainingClient) -> types.Datum:
    """An RL datum whose sampler log-probs q are the current weights' log p minus log RATIOS."""
    tokens = types.ModelInput.from_ints(RL_TOKENS)
    targets = RL_TOKENS[1:] + [5]
    now = training.forward([types.Datum(model_input=tokens, loss_fn_inputs={
        "target_tokens": targets, "weights": [1.0] * len(targets)})], "cross_entropy").result()
    current = now.loss_fn_outputs[0]["logprobs"].tolist()
    return types.Datum(model_input=tokens, loss_fn_inputs={
        "target_tokens": targets, "logprobs": [lp - math.log(r) for lp, r in zip(current, RATIOS, strict=True)],
        "advantages": ADVANTAGES})


async def test_the_sdk_trains_a_lora_model_through_the_gateway(lora_trainer, service_model: Path) -> None:
    address, checkpoints = lora_trainer
    async with gateway_on(address, checkpoints / "tinker") as (gateway, url):
        out = await asyncio.to_thread(train_with_the_sdk, url, str(service_model))
        info, forward, first = out["info"], out["forward"], out["first"]
        assert info.is_lora and info.lora_rank == 4 and info.model_data.tokenizer_id == str(service_model)
        # forward is forward_backward's pass without the backward: the same log-probs, the same loss.
        for ours, theirs in zip(forward.loss_fn_outputs, first.loss_fn_outputs, strict=True):
            assert ours["logprobs"].tolist() == pytest.approx(theirs["logprobs"].tolist(), abs=1e-5)
        assert forward.metrics["loss:sum"] == pytest.approx(first.metrics["loss:sum"], rel=1e-5)
        # cross_entropy is Tinker's sum: -Σ weight x log-prob, over the very log-probs returned.
        expected = -sum(w * lp for d, o in zip(fixed_data(), first.loss_fn_outputs)
                        for w, lp in zip(d.loss_fn_inputs["weights"].tolist(), o["logprobs"].tolist()))
        assert first.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
        assert [len(o["logprobs"].tolist()) for o in first.loss_fn_outputs] == [6, 4]
        losses = out["losses"]
        assert losses[-1] < 0.8 * losses[0], losses  # five steps on a fixed batch learn it
        assert out["saved"].path == f"tinker://{out['model_id']}/weights/after-five"
        assert (checkpoints / "tinker" / "alice" / out["model_id"] / "after-five" / "tinker.json").is_file()
        assert out["again"] is not None and out["again"].category == types.RequestErrorCategory.User
        assert "exists" in str(out["again"])
        # Tinker's ppo and cispo, on the log-probs of their own pass: p/q is RATIOS (to float32's precision).
        low, high = CLIP_CONFIG["clip_low_threshold"], CLIP_CONFIG["clip_high_threshold"]
        sampler = out["rl"].loss_fn_inputs["logprobs"].tolist()  # as sent: float32
        for loss, result in out["clipped"].items():
            logprobs = result.loss_fn_outputs[0]["logprobs"].tolist()
            ratios = [math.exp(lp - q) for lp, q in zip(logprobs, sampler, strict=True)]
            assert ratios == pytest.approx(RATIOS, abs=1e-4)
            clipped = [min(max(r, low), high) for r in ratios]
            if loss == "ppo":  # -min(r A, clip(r) A): by hand -1.3 - 1.0 - 0.55 + 1.5 + 0.9 = -0.45
                expected = -sum(min(r * a, c * a) for r, c, a in zip(ratios, clipped, ADVANTAGES, strict=True))
                assert expected == pytest.approx(-0.45, abs=1e-3)
            else:  # -clip(r) A log p
                expected = -sum(c * a * lp for c, a, lp in zip(clipped, ADVANTAGES, logprobs, strict=True))
            assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5), loss
        unserved, unknown_setting = out["refused"]
        assert unserved is not None and unserved.category == types.RequestErrorCategory.User
        assert "loss_fn 'dro' is not served" in str(unserved)
        assert unknown_setting is not None and unknown_setting.category == types.RequestErrorCategory.User
        assert "kl_coeff not served for ppo" in str(unknown_setting)
        session = next(iter(gateway.sessions._sessions.values()))
        assert session.ended == "success"


async def test_keys_are_checked_and_a_forward_backward_sent_again_is_the_same_request(
    lora_trainer, service_model: Path
) -> None:
    address, checkpoints = lora_trainer
    async with gateway_on(address, checkpoints / "tinker") as (gateway, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.get("/api/v1/healthz")).json() == {"status": "ok"}  # no key needed
            assert (await http.post("/api/v1/create_session", json={})).status_code == 401
            refused = await http.post("/api/v1/create_session", json={}, headers={"X-API-Key": AGENT_KEY})
            assert refused.status_code == 403 and "takes a tenant's key" in refused.text
            staff = await http.post("/api/v1/create_session", json={}, headers={"X-API-Key": SERVICE_KEY})
            assert staff.status_code == 403 and "this is a service token" in staff.text
            headers = {"X-API-Key": KEY}
            session = (await http.post("/api/v1/create_session", json={"tags": []}, headers=headers)).json()
            created = (await http.post("/api/v1/create_model", headers=headers, json={
                "session_id": session["session_id"], "model_seq_id": 0, "base_model": str(service_model),
                "lora_config": {"rank": 4}})).json()
            done = (await http.post("/api/v1/retrieve_future", headers=headers,
                                    json={"request_id": created["request_id"]})).json()
            assert done == {"type": "create_model", "model_id": created["model_id"]}
            from tinker.proto.request_conv import forward_backward_request_to_proto

            body = forward_backward_request_to_proto(types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=fixed_data(), loss_fn="cross_entropy"),
                model_id=created["model_id"], seq_id=1)).SerializeToString()
            proto = {**headers, "Content-Type": "application/x-protobuf"}
            first = (await http.post("/api/v1/forward_backward", content=body, headers=proto)).json()
            again = (await http.post("/api/v1/forward_backward", content=body, headers=proto)).json()
            assert first == again  # the SDK's retry of seq_id 1: one request, run once
            as_json = await http.post("/api/v1/retrieve_future", headers=headers,
                                      json={"request_id": first["request_id"]})
            assert as_json.status_code == 400 and "Accept: application/x-protobuf" in as_json.text
            unknown = await http.post("/api/v1/asample_everything", headers=headers, json={})
            assert unknown.status_code == 404 and "is not served by this gateway" in unknown.text




def sample_with_the_sdk(url: str, base_model: str) -> dict:
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=base_model, rank=4).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    prompt = types.ModelInput.from_ints(PROMPT)
    first = training.save_weights_and_get_sampling_client().result()  # the base weights: version 0
    base = first.sample(prompt, num_samples=3, sampling_params=params).result()
    sequence = base.sequences[0]
    tokens = PROMPT + sequence.tokens
    scored = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "weights": [0.0] * (len(PROMPT) - 1) + [1.0] * len(sequence.tokens)})
    forward = training.forward([scored], "cross_entropy").result()
    # compute_logprobs: a sample request with prompt_logprobs, on the base model (version 0, served now).
    prompt_logprobs = first.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    last_two = first.compute_logprobs(types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=2).result()
    topk = first.sample(prompt, num_samples=1, sampling_params=params, topk_sample_logprobs=3).result()
    # The RL step Tinker's recipes take: the sampler's log-probs and advantages, importance-sampled.
    n = len(sequence.tokens)
    rl = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "logprobs": [0.0] * (len(PROMPT) - 1) + list(sequence.logprobs),
        "advantages": [0.0] * (len(PROMPT) - 1) + [0.5] * n})
    importance = training.forward_backward([rl], "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=0.0)).result()  # nothing moves: the next step is CE's
    training.forward_backward(fixed_data(), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    second = training.save_weights_and_get_sampling_client().result()  # version 2, installed on the rollout
    trained = second.sample(prompt, num_samples=1, sampling_params=params).result()
    # The first client is pinned to version 0: the replica goes back to the base model for it.
    older = first.sample(prompt, num_samples=3, sampling_params=params).result()
    named = training.save_weights_for_sampler("named", ttl_seconds=3600, user_metadata={"step": "2"}).result().path
    by_path = service.create_sampling_client(model_path=named).result()
    stopped = by_path.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=6, stop=[trained.sequences[0].tokens[0]], seed=7)).result()
    try:
        by_path.sample(prompt, num_samples=1, sampling_params=params, prompt_alt_tokens_k=2).result()
        refused = None
    except Exception as exc:  # noqa: BLE001 - the SDK raises a RequestFailedError or a BadRequestError
        refused = exc
    service.close("success").result()
    # The next user's model starts from the base weights: so does the sampler (its versions count from 0).
    after = tinker.ServiceClient(base_url=url, api_key=KEY)
    fresh = after.create_lora_training_client(base_model=base_model, rank=4).result()
    again = fresh.save_weights_and_get_sampling_client().result().sample(
        prompt, num_samples=3, sampling_params=params).result()
    after.close("success").result()
    return {"base": base, "forward": forward, "importance": importance, "trained": trained, "again": again,
            "older": older, "named": named,
            "stopped": stopped, "prompt_logprobs": prompt_logprobs, "last_two": last_two, "topk": topk, "refused": refused,
            "model_id": training.model_id}



@pytest.mark.parametrize("served", ["adapters", "merged"])
async def test_the_sdk_samples_the_saved_weights_on_an_exact_version(
    lora_trainer_for_sampling, request: pytest.FixtureRequest, served: str, untied_model: Path
) -> None:
    """Both ways a sampler serves saves: each an adapter beside the others on the unchanged base (what
    `flywheel up --with tinker` starts), or merged weights loaded one version at a time."""
    address, checkpoints = lora_trainer_for_sampling
    rollout = request.getfixturevalue("rollout" if served == "adapters" else "merged_rollout")
    async with gateway_on(address, checkpoints / "tinker", rollout, sampler_dir=checkpoints / "sampler") as (
        gateway, url
    ):
        out = await asyncio.to_thread(sample_with_the_sdk, url, str(untied_model))
        base = out["base"]
        assert len(base.sequences) == 3 and len({s.sequence_id for s in base.sequences}) == 3
        sequence = base.sequences[0]
        assert 1 <= len(sequence.tokens) <= 6 and len(sequence.logprobs) == len(sequence.tokens)
        # The sampler's log-probs of its tokens are forward()'s on the same tokens (temperature 1, no truncation).
        scored = out["forward"].loss_fn_outputs[0]["logprobs"].tolist()[-len(sequence.tokens):]
        assert sequence.logprobs == pytest.approx(scored, abs=1e-5)  # measured: 4.8e-7 (float32 both sides)
        # Same weights sampled and trained: every ratio p/q is 1, so the loss is -Σ advantage.
        assert out["importance"].metrics["loss:sum"] == pytest.approx(-0.5 * len(sequence.tokens), rel=1e-4)
        assert len(out["trained"].sequences[0].tokens) >= 1
        # The client of version 0 sampled the base model again after version 2 was installed: the same samples.
        assert [s.tokens for s in out["older"].sequences] == [s.tokens for s in base.sequences]
        assert out["named"] == f"tinker://{out['model_id']}/sampler_weights/named"
        (record,) = [json.loads(p.read_text()) for p in (checkpoints / "sampler").glob("*/*/save-*/version_*/tinker.json")
                     if json.loads(p.read_text())["name"] == "named"]
        assert record["version"] == 2 and record["user_metadata"] == {"step": "2"}
        # An adapter travels as the adapter alone (no base weights); merged weights as a whole model.
        files = {p.name for p in (checkpoints / "sampler").glob("*/*/save-*/version_2/*")}
        assert record["adapter"] == (served == "adapters")
        assert ("adapter_model.safetensors" in files) == (served == "adapters") != ("model.safetensors" in files)
        assert record["expires"] - record["created"] == 3600  # removed at a save after that
        stopped = out["stopped"].sequences[0]
        assert stopped.stop_reason == "stop" and len(stopped.tokens) <= 1  # the stop token itself ends it
        assert "prompt_alt_tokens_k is not served" in str(out["refused"])
        # compute_logprobs on the base model: forward()'s log-probs of the same tokens, None for the first.
        scored_all = out["forward"].loss_fn_outputs[0]["logprobs"].tolist()
        prompt_logprobs = out["prompt_logprobs"]
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT) + len(sequence.tokens)
        print(f"compute_logprobs vs forward: largest gap "
              f"{max(abs(a - b) for a, b in zip(prompt_logprobs[1:], scored_all)):.2e}")
        assert prompt_logprobs[1:] == pytest.approx(scored_all, abs=1e-5)  # measured: 4.8e-7 (float32 both sides)
        last_two = out["last_two"]  # prompt_logprobs_last_n=2: the positions before the last two are None
        assert last_two[:-2] == [None] * (len(prompt_logprobs) - 2)
        assert last_two[-2:] == pytest.approx(prompt_logprobs[-2:], abs=1e-6)
        # topk_sample_logprobs: the 3 likeliest tokens at each sampled position, most likely first, of the
        # distribution the token was drawn from (here temperature 1, nothing cut: the model's).
        (topk,) = out["topk"].sequences
        assert topk.tokens == sequence.tokens and len(topk.topk_logprobs) == len(topk.tokens)  # the same seed
        for token, logprob, row in zip(topk.tokens, topk.logprobs, topk.topk_logprobs, strict=True):
            assert len(row) == 3 and [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
            assert logprob <= row[0][1]
            if token in dict(row):
                assert dict(row)[token] == pytest.approx(logprob, abs=1e-6)
        # A new model's weights before it trained are the base model's: sampled as version 0 again.
        assert (await gateway.sampler.rollout.status()).weight_version == 0
        assert [s.tokens for s in out["again"].sequences] == [s.tokens for s in base.sequences]


def resume_with_the_sdk(url: str, base_model: str) -> dict:
    data = fixed_data()
    adam = types.AdamParams(learning_rate=2e-2)
    first = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = first.create_lora_training_client(base_model=base_model, rank=4,
                                                 user_metadata={"renderer": "role_colon"}).result()
    for _ in range(2):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam).result()
    saved = training.save_state("mid").result().path
    # Another client trains its own model on the same trainer meanwhile: it changes nothing of this one's.
    other = tinker.ServiceClient(base_url=url, api_key=KEY)
    neighbour = other.create_lora_training_client(base_model=base_model, rank=4).result()
    neighbour.forward_backward(data[:1], "cross_entropy").result()  # gradients left pending, then a step
    uninterrupted = []
    for _ in range(2):
        uninterrupted.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        neighbour.optim_step(types.AdamParams(learning_rate=0.1)).result()
        neighbour.forward_backward(data[1:], "cross_entropy").result()
        training.optim_step(adam).result()
    other.close("success").result()
    run = first.create_rest_client().get_training_run_by_tinker_path(saved).result()
    first.close("success").result()

    second = tinker.ServiceClient(base_url=url, api_key=KEY)
    resumed = second.create_training_client_from_state_with_optimizer(saved).result()
    again = []
    for _ in range(2):
        again.append(resumed.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        resumed.optim_step(adam).result()
    try:
        second.create_training_client_from_state(saved).result()  # weights without the optimizer
        weights_only = None
    except tinker.RequestFailedError as exc:
        weights_only = exc
    second.close("success").result()
    return {"uninterrupted": uninterrupted, "again": again, "run": run, "saved": saved,
            "weights_only": weights_only}


async def test_a_new_session_resumes_from_a_save_with_its_optimizer_state(lora_trainer, service_model: Path) -> None:
    address, checkpoints = lora_trainer
    async with gateway_on(address, checkpoints / "tinker") as (gateway, url):
        out = await asyncio.to_thread(resume_with_the_sdk, url, str(service_model))
    # Weights and Adam's moments both come back: the two steps after the save repeat exactly (and the
    # neighbour's steps in between did not move them).
    assert out["again"] == pytest.approx(out["uninterrupted"], rel=1e-5)
    run = out["run"]
    assert run.base_model == str(service_model) and run.is_lora and run.lora_rank == 4
    assert run.user_metadata == {"renderer": "role_colon"} and run.last_checkpoint.tinker_path == out["saved"]
    assert out["weights_only"] is not None and "without their optimizer state" in str(out["weights_only"])


def train_and_sample(url: str, base_model: str, data: list, learning_rate: float, both_created, key: str = KEY,
                     rank: int = 4, train_mlp: bool = True) -> dict:
    """One client's run: three steps on its own data, then samples of its weights scored by its forward()."""
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=base_model, rank=rank, train_mlp=train_mlp).result()
    if both_created is not None:
        both_created.wait(timeout=60)  # the two clients train at once from here
    losses = []
    for _ in range(3):
        losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    sampled, scored = [], []
    for _ in range(2):  # the other client's samples and saves come in between: the replica switches back
        sequence = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=1,
                                  sampling_params=params).result().sequences[0]
        tokens = PROMPT + sequence.tokens
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)})
        sampled.append(list(sequence.logprobs))
        scored.append(training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
                      .tolist()[-len(sequence.tokens):])
    service.close("success").result()
    return {"losses": losses, "sampled": sampled, "scored": scored, "model_id": training.model_id}


async def test_two_tenants_train_and_sample_at_once_without_touching_each_others_weights(
    lora_trainer_for_sampling, rollout, untied_model: Path
) -> None:
    import threading

    address, checkpoints = lora_trainer_for_sampling
    data_a, data_b = fixed_data(), fixed_data()[::-1][:1]
    async with gateway_on(address, checkpoints / "tinker", rollout, sampler_dir=checkpoints / "sampler") as (
        gateway, url
    ):
        barrier = threading.Barrier(2)
        # Two tenants, each on its own key; bob's model is a LoRA of its own: rank 2 (the trainer's is 4),
        # without the MLP's adapters.
        together = await asyncio.gather(
            asyncio.to_thread(train_and_sample, url, str(untied_model), data_a, 2e-2, barrier, KEY),
            asyncio.to_thread(train_and_sample, url, str(untied_model), data_b, 5e-2, barrier, BOB_KEY, 2, False))
        alone = [await asyncio.to_thread(train_and_sample, url, str(untied_model), data, lr, None, KEY, *shape)
                 for data, lr, shape in ((data_a, 2e-2, (4, True)), (data_b, 5e-2, (2, False)))]
        # Bob's saves for the sampler are adapters of his model's own shape.
        bob = json.loads((checkpoints / "tinker" / "bob" / together[1]["model_id"] / "run.json").read_text())
        assert bob["lora_rank"] == 2
        configs = [json.loads(p.read_text()) for p in
                   (checkpoints / "sampler" / "bob").glob("*/save-*/version_*/adapter_config.json")]
        assert configs and all(c["r"] == 2 and "gate_proj" not in c["target_modules"] for c in configs)
        for run in together:
            assert gateway.models.known(run["model_id"]).retired.startswith("its session finished")
        for _ in range(50):  # a finished session's models are dropped in the background
            held = list((await gateway.trainer.get_info()).model_ids)
            if held == [""]:
                break
            await asyncio.sleep(0.1)
        assert held == [""]  # every finished client's model was dropped from the trainer
    for concurrent, solo in zip(together, alone):
        # Interleaved on one trainer, each model trains exactly as it does alone.
        assert concurrent["losses"] == pytest.approx(solo["losses"], rel=1e-6)
        # Each client's samples come from its own weights (its forward() gives the sampler's log-probs).
        for sampled, scored in zip(concurrent["sampled"], concurrent["scored"]):
            assert sampled == pytest.approx(scored, abs=1e-5)
    assert together[0]["losses"][-1] != pytest.approx(together[1]["losses"][-1], rel=1e-2)  # two different models


def alice_trains_and_saves(url: str, base_model: str) -> dict:
    """Tenant alice: a model with one step, a named save, named sampler weights and a sampler of them."""
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=base_model, rank=4).result()
    training.forward_backward(fixed_data(), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    state = training.save_state("a1").result().path
    weights = training.save_weights_for_sampler("s1").result().path
    sampler = service.create_sampling_client(model_path=weights).result()
    sample = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, SEEDED).result().sequences[0]
    return {"service": service, "training": training, "state": state, "weights": weights,
            "sampler_id": sampler._sampling_session_id, "sample": (sample.tokens, sample.logprobs)}


SEEDED = types.SamplingParams(max_tokens=4, temperature=1.0, seed=5)


def bob_saves_the_same_number(url: str, base_model: str) -> dict:
    """Tenant bob, on a trainer that restarted (its versions count from 1 again): one step, saved for the
    sampler, sampled, and scored by its own forward()."""
    service = tinker.ServiceClient(base_url=url, api_key=BOB_KEY)
    training = service.create_lora_training_client(base_model=base_model, rank=4).result()
    training.forward_backward(fixed_data()[1:], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    sequence = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, SEEDED).result().sequences[0]
    tokens = PROMPT + sequence.tokens
    scored = training.forward([types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)})], "cross_entropy").result()
    service.close("success").result()
    return {"model_id": training.model_id, "sampled": list(sequence.logprobs),
            "scored": scored.loss_fn_outputs[0]["logprobs"].tolist()[-len(sequence.tokens):]}


def alice_samples_her_named_weights(url: str, path: str) -> tuple[list[int], list[float]]:
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    sequence = service.create_sampling_client(model_path=path).result().sample(
        types.ModelInput.from_ints(PROMPT), 1, SEEDED).result().sequences[0]
    service.close("success").result()
    return sequence.tokens, sequence.logprobs


def after_the_trainer_restarted(alice: dict) -> dict:
    """Every request of alice's lost model is refused; a save loaded into a new model trains."""
    training, refused = alice["training"], []
    for call in (lambda: training.forward_backward(fixed_data(), "cross_entropy").result(),
                 lambda: training.optim_step(types.AdamParams(learning_rate=2e-2)).result(),
                 lambda: training.save_state("after").result()):
        try:
            call()
            refused.append(None)
        except Exception as exc:  # noqa: BLE001 - a RequestFailedError (in the future) or a 400 (at once)
            refused.append(str(exc))
    resumed = alice["service"].create_training_client_from_state_with_optimizer(alice["state"]).result()
    loss = resumed.forward_backward(fixed_data(), "cross_entropy").result().metrics["loss:sum"]
    alice["service"].close("success").result()
    return {"refused": refused, "loss": loss, "resumed": resumed.model_id}


async def every_rpc_refused(address: str, descriptor, key: str) -> dict[str, str]:
    """Each RPC of `descriptor` called with `key`: method -> status code name."""
    import grpc

    codes = {}
    async with grpc.aio.insecure_channel(address) as channel:
        for method in descriptor.methods:
            path, raw = f"/{descriptor.full_name}/{method.name}", lambda b: b
            kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                    (True, False): channel.stream_unary, (True, True): channel.stream_stream}
            call = kind[(method.client_streaming, method.server_streaming)](path, request_serializer=raw,
                                                                            response_deserializer=raw)
            request = iter([b""]) if method.client_streaming else b""
            try:
                answer = call(request, metadata=(("authorization", f"Bearer {key}"),), timeout=10)
                if method.server_streaming:
                    async for _ in answer:
                        pass
                else:
                    await answer
                codes[method.name] = "OK"
            except grpc.aio.AioRpcError as exc:
                codes[method.name] = exc.code().name
    return codes


async def test_a_tenant_opens_only_the_tinker_api_sees_only_its_own_and_a_lost_model_stays_lost(
    run_service, service_env, rollout, untied_model: Path, tmp_path: Path
) -> None:
    from flywheel.synchronizer.v1 import synchronizer_pb2
    from flywheel.trainer.v1 import trainer_pb2
    from services.tinker import metrics
    from flywheel.testing.net import free_port

    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"service: {SERVICE_KEY}\ntenants: {{alice: [{KEY}], bob: [{BOB_KEY}]}}\n")
    add_tenant_key(tokens, "carol")  # the tokens tool adds a key and keeps the others
    env = {**service_env, "FLYWHEEL_TOKENS_FILE": str(tokens)}
    checkpoints = tmp_path / "trainer-checkpoints"
    lora = ("--model.path", str(untied_model), "--checkpoint.dir", str(checkpoints), "--model.lora.enabled", "true",
            "--model.lora.rank", "4", "--model.lora.target-modules", ADAPTED, "--server.port", str(free_port()))
    trainer = run_service("trainer", *lora, env=env)
    address = trainer.grpc_address
    synchronizer = run_service("synchronizer", env=env).grpc_address
    # A tenant key opens no RPC of the trainer or the synchronizer: each knows it, and refuses it.
    for where, service in ((address, trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]),
                           (synchronizer, synchronizer_pb2.DESCRIPTOR.services_by_name["SynchronizerService"])):
        codes = await every_rpc_refused(where, service, KEY)
        assert set(codes.values()) == {"PERMISSION_DENIED"}, codes
        assert len(codes) == len(service.methods)

    async with gateway_on(address, checkpoints / "tinker", rollout, sampler_dir=checkpoints / "sampler") as (
        gateway, url
    ):
        alice = await asyncio.to_thread(alice_trains_and_saves, url, str(untied_model))
        model = alice["training"].model_id
        bob = {"X-API-Key": BOB_KEY}
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=bob) as http:
            session = (await http.post("/api/v1/create_session", json={})).json()["session_id"]
            # Bob finds nothing of alice's: her model, run, checkpoints, samplers, requests; by id and by path.
            not_found = [
                await http.post("/api/v1/get_info", json={"model_id": model}),
                await http.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 9, "adam_params": {}}),
                await http.get(f"/api/v1/training_runs/{model}"),
                await http.get(f"/api/v1/training_runs/{model}/checkpoints"),
                await http.post("/api/v1/weights_info", json={"tinker_path": alice["state"]}),
                await http.post("/api/v1/load_weights", json={"session_id": session, "model_seq_id": 0,
                                                              "path": alice["state"], "optimizer": True}),
                await http.post("/api/v1/create_sampling_session", json={
                    "session_id": session, "sampling_session_seq_id": 0, "model_path": alice["weights"]}),
                await http.get(f"/api/v1/samplers/{alice['sampler_id']}"),
                await http.post("/api/v1/asample", json={"sampling_session_id": alice["sampler_id"], "seq_id": 0,
                                                         "prompt": {"chunks": []}, "sampling_params": {}}),
                await http.post("/api/v1/retrieve_future", json={"request_id": "create_model-1"}),
                await http.delete(f"/api/v1/training_runs/{model}/checkpoints/weights/a1"),
            ]
            assert [r.status_code for r in not_found] == [404] * len(not_found), [r.text for r in not_found]
            assert (await http.get("/api/v1/training_runs")).json()["training_runs"] == []
            assert (await http.get("/api/v1/checkpoints")).json()["checkpoints"] == []
            # Paths are parsed strictly: '..', absolute and extra components are refused, whoever asks.
            for path in ("tinker://../weights/a1", "tinker:///etc/passwd", f"tinker://{model}/weights/../../x",
                         f"tinker://{model}/weights/a1/more"):
                answer = await http.post("/api/v1/weights_info", json={"tinker_path": path})
                assert answer.status_code == 400 and "tinker://" in answer.text, (path, answer.text)
        listed = await asyncio.to_thread(lambda: tinker.RestClient(base_url=url, api_key=KEY).list_user_checkpoints()
                                         .result())
        assert {c.tinker_path for c in listed.checkpoints} == {alice["state"], alice["weights"]}
        assert metrics.TENANT_REQUESTS.labels("bob")._value.get() >= len(not_found)
        assert metrics.TENANT_DISK.labels("alice")._value.get() > 0

        # The trainer restarts (a crash): alice's model is gone with it, and stays gone.
        trainer.process.kill()
        trainer.process.wait()
        assert run_service("trainer", *lora, env=env).grpc_address == address
        # Bob's model saves weights under the number alice's named ones have: each samples its own weights.
        bob_run = await asyncio.to_thread(bob_saves_the_same_number, url, str(untied_model))
        numbered = {w.model_id: w for w in gateway.sampler._saved if w.model_id in (model, bob_run["model_id"])}
        assert numbered[model].version == numbered[bob_run["model_id"]].version  # the same number ...
        assert numbered[model].identity != numbered[bob_run["model_id"]].identity  # ... two identities
        assert bob_run["sampled"] == pytest.approx(bob_run["scored"], abs=1e-5)  # bob's samples: his weights
        again = await asyncio.to_thread(alice_samples_her_named_weights, url, alice["weights"])
        assert again[0] == alice["sample"][0] and again[1] == pytest.approx(alice["sample"][1], abs=1e-6)
        after = await asyncio.to_thread(after_the_trainer_restarted, alice)
        assert all(r is not None and "no longer holds model" in r for r in after["refused"]), after["refused"]
        assert math.isfinite(after["loss"]) and after["resumed"] != model


