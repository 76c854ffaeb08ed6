"""Every public method of the official Tinker SDK's four clients (tinker==0.38: ServiceClient,
TrainingClient, SamplingClient, RestClient) called on the gateway over a real trainer and rollout:
each is served, refused by name, or done in the client, as the conformance table in docs/tinker.md
(tests/integration/tinker_surface.py) says."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.integration.tinker_gateway_helpers import (  # noqa: F401 - the fixtures among them
    KEY, PROMPT, fixed_data, gateway_on, lora_trainer_for_sampling, rollout, untied_model,
)

pytestmark = pytest.mark.slow


#: Each SDK call of the walk waits at most this long: a call that never answers fails by name, not by the
#: suite's timeout (whose teardown then waits on the SDK's thread forever).
CALL_SECONDS = 60.0


def walk_the_surface(url: str, base_model: str) -> dict[str, str]:
    """Calls every public method of the SDK's four clients (tests/integration/tinker_surface.py) on the gateway:
    "Class.method" -> "served", "refused: <message>" or "client" (no server call made)."""
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    rest = tinker.RestClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=base_model, rank=4).result(CALL_SECONDS)
    data, prompt = fixed_data(), types.ModelInput.from_ints(PROMPT)
    training.forward_backward(data, "cross_entropy").result(CALL_SECONDS)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(CALL_SECONDS)
    state = training.save_state("walk").result(CALL_SECONDS).path
    weights = training.save_weights_for_sampler("walked").result(CALL_SECONDS).path
    sampler = training.save_weights_and_get_sampling_client().result(CALL_SECONDS)
    model, session = training.model_id, service.holder.get_session_id()
    external = f"tinker://{model}/external_weights/x"

    def custom_loss(data, logprobs):
        loss = sum(-lp.sum() for lp in logprobs)
        return loss, {"custom": float(loss)}

    def server_loss(logprobs):  # the shape create_custom_loss traces: log-probs first, then its inputs
        loss = -logprobs.sum()
        return loss, {"custom/neg_ll:sum": loss}

    calls = {
        "ServiceClient.copy_weights": lambda: service.copy_weights(state).result(CALL_SECONDS),
        "ServiceClient.create_custom_loss": lambda: service.create_custom_loss(server_loss, {"logprobs": 1}).result(CALL_SECONDS),
        "ServiceClient.create_lora_training_client": lambda: service.create_lora_training_client(
            base_model=base_model, rank=4).result(CALL_SECONDS),
        "ServiceClient.create_sampling_client": lambda: service.create_sampling_client(model_path=weights).result(CALL_SECONDS),
        "ServiceClient.create_training_client_from_state": lambda: service.create_training_client_from_state(
            state).result(CALL_SECONDS),
        "ServiceClient.create_training_client_from_state_with_optimizer":
            lambda: service.create_training_client_from_state_with_optimizer(state).result(CALL_SECONDS),
        "ServiceClient.get_server_capabilities": lambda: service.get_server_capabilities(),
        "TrainingClient.create_sampling_client": lambda: training.create_sampling_client(weights).result(CALL_SECONDS),
        "TrainingClient.forward": lambda: training.forward(data, "cross_entropy").result(CALL_SECONDS),
        "TrainingClient.forward_backward": lambda: training.forward_backward(data, "cross_entropy").result(CALL_SECONDS),
        "TrainingClient.forward_backward_custom": lambda: training.forward_backward_custom(data, custom_loss).result(CALL_SECONDS),
        "TrainingClient.optim_step": lambda: training.optim_step(types.AdamParams(learning_rate=1e-3)).result(CALL_SECONDS),
        "TrainingClient.get_info": lambda: training.get_info(),
        "TrainingClient.load_state": lambda: training.load_state(state).result(CALL_SECONDS),
        "TrainingClient.load_state_with_optimizer": lambda: training.load_state_with_optimizer(state).result(CALL_SECONDS),
        "TrainingClient.save_state": lambda: training.save_state("walk-2").result(CALL_SECONDS),
        "TrainingClient.save_weights_and_get_sampling_client":
            lambda: training.save_weights_and_get_sampling_client().result(CALL_SECONDS),
        "TrainingClient.save_weights_external": lambda: training.save_weights_external("x").result(CALL_SECONDS),
        "TrainingClient.save_weights_for_sampler": lambda: training.save_weights_for_sampler("walked-2").result(CALL_SECONDS),
        "SamplingClient.compute_logprobs": lambda: sampler.compute_logprobs(prompt).result(CALL_SECONDS),
        "SamplingClient.get_base_model": lambda: sampler.get_base_model(),
        "SamplingClient.sample": lambda: sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result(CALL_SECONDS),
        "RestClient.assign_session_project": lambda: rest.assign_session_project(session, "p").result(CALL_SECONDS),
        "RestClient.copy_weights": lambda: rest.copy_weights(state).result(CALL_SECONDS),
        "RestClient.export_session_trace": lambda: rest.export_session_trace(session).result(CALL_SECONDS),
        "RestClient.get_audit_log": lambda: rest.get_audit_log().result(CALL_SECONDS),
        "RestClient.get_billing_usage": lambda: rest.get_billing_usage("2026-01-01", "2026-02-01").result(CALL_SECONDS),
        "RestClient.get_current_checkpoint_storage_usage": lambda: rest.get_current_checkpoint_storage_usage().result(CALL_SECONDS),
        "RestClient.get_external_weights_urls": lambda: rest.get_external_weights_urls(external).result(CALL_SECONDS),
        "RestClient.get_sampler": lambda: rest.get_sampler(sampler._sampling_session_id).result(CALL_SECONDS),
        "RestClient.get_server_capabilities": lambda: rest.get_server_capabilities().result(CALL_SECONDS),
        "RestClient.get_session": lambda: rest.get_session(session).result(CALL_SECONDS),
        "RestClient.get_training_run": lambda: rest.get_training_run(model).result(CALL_SECONDS),
        "RestClient.get_training_run_by_tinker_path": lambda: rest.get_training_run_by_tinker_path(state).result(CALL_SECONDS),
        "RestClient.get_weights_info_by_tinker_path": lambda: rest.get_weights_info_by_tinker_path(state).result(CALL_SECONDS),
        "RestClient.list_checkpoints": lambda: rest.list_checkpoints(model).result(CALL_SECONDS),
        "RestClient.list_sessions": lambda: rest.list_sessions().result(CALL_SECONDS),
        "RestClient.list_training_runs": lambda: rest.list_training_runs().result(CALL_SECONDS),
        "RestClient.list_user_checkpoints": lambda: rest.list_user_checkpoints().result(CALL_SECONDS),
        "RestClient.publish_checkpoint_from_tinker_path": lambda: rest.publish_checkpoint_from_tinker_path(
            state).result(CALL_SECONDS),
        "RestClient.search_sessions": lambda: rest.search_sessions(types.SessionSearchRequest()).result(CALL_SECONDS),
        "RestClient.set_checkpoint_ttl_from_tinker_path": lambda: rest.set_checkpoint_ttl_from_tinker_path(
            state, 7200).result(CALL_SECONDS),
        "RestClient.unpublish_checkpoint_from_tinker_path": lambda: rest.unpublish_checkpoint_from_tinker_path(
            state).result(CALL_SECONDS),
        "RestClient.whoami": lambda: rest.whoami().result(CALL_SECONDS),
        # Deletions last: what they delete is used above.
        "RestClient.delete_checkpoint": lambda: rest.delete_checkpoint(model, "weights/walk-2").result(CALL_SECONDS),
        "RestClient.delete_checkpoint_from_tinker_path": lambda: rest.delete_checkpoint_from_tinker_path(
            weights).result(CALL_SECONDS),
        "ServiceClient.close": lambda: service.close("success").result(CALL_SECONDS),
    }
    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = "served"
        except TimeoutError:
            seen[name] = f"no answer in {CALL_SECONDS:.0f} s"
        except Exception as exc:  # noqa: BLE001 - whatever the SDK raises for a refusal
            seen[name] = f"refused: {exc}"
    return seen


async def test_every_public_method_of_the_sdk_is_served_or_refused_by_name(
    lora_trainer_for_sampling, rollout, untied_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # copy_weights names the project it copies into (else the SDK refuses before any call).
    monkeypatch.setenv("TINKER_PROJECT_ID", "walk")
    from tests.integration.tinker_surface import SURFACE, public_methods, render, sdk_classes

    # The table covers every public method of the SDK's four clients (an `_async` twin goes with its method).
    for cls, methods in SURFACE.items():
        public = public_methods(sdk_classes()[cls])
        assert sorted({m.removesuffix("_async") if m.removesuffix("_async") in public else m for m in public}) \
            == sorted(methods), cls
    documented = (Path(__file__).resolve().parents[2] / "docs" / "tinker.md").read_text()
    assert render() in documented, "docs/tinker.md's surface table differs: python -m tests.integration.tinker_surface"
    address, checkpoints = lora_trainer_for_sampling
    async with gateway_on(address, checkpoints / "tinker", rollout, sampler_dir=checkpoints / "sampler") as (_, url):
        seen = await asyncio.to_thread(walk_the_surface, url, str(untied_model))
    wrong = {}
    for cls, methods in SURFACE.items():
        for name, (verdict, note) in methods.items():
            got = seen.get(f"{cls}.{name}")
            if verdict == "client":
                assert got in (None, "served"), (name, got)  # done in the SDK: nothing refused
            elif verdict == "served" and got != "served":
                wrong[f"{cls}.{name}"] = got
            elif verdict == "refused" and not (got or "").startswith("refused") or verdict == "refused" and \
                    note not in (got or ""):
                wrong[f"{cls}.{name}"] = got
    assert not wrong, "\n".join(f"{k}: {SURFACE[k.split('.')[0]][k.split('.')[1]][0]} expected, got {v}" for k, v in wrong.items())
