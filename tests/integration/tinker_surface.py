"""The SDK's public surface (tinker==0.38): every public method of ServiceClient, TrainingClient,
SamplingClient and RestClient, with what the gateway does with it. `test_every_public_method_of_the_sdk_is_
served_or_refused_by_name` calls each against a live gateway; docs/tinker.md's table is `render()`'s."""

from __future__ import annotations

import inspect

#: (verdict, what a refusal's message says or a note): served, refused (by the gateway, or by the SDK
#: itself where the gateway's client config turns the feature off), or client (no server call).
SURFACE: dict[str, dict[str, tuple[str, str]]] = {
    "ServiceClient": {
        "close": ("served", "POST sessions/{id}/finish"),
        "copy_weights": ("refused", "copying weights between runs"),
        "create_custom_loss": ("client", "traced and kept by the SDK: the client config turns server-side custom "
                                         "losses off, so forward_backward_custom runs it client-side"),
        "create_lora_training_client": ("served", "POST create_model"),
        "create_rest_client": ("client", "makes a RestClient"),
        "create_sampling_client": ("served", "POST create_sampling_session"),
        "create_training_client_from_state": ("refused", "weights without their optimizer state"),
        "create_training_client_from_state_with_optimizer": ("served", "POST load_weights (create-via-load)"),
        "get_console_url": ("client", "a URL of Tinker's own console"),
        "get_server_capabilities": ("served", "GET get_server_capabilities"),
        "get_telemetry": ("client", "the SDK's telemetry object"),
    },
    "TrainingClient": {
        "create_sampling_client": ("served", "POST create_sampling_session"),
        "forward": ("served", "POST forward_backward (forward only)"),
        "forward_backward": ("served", "POST forward_backward"),
        "forward_backward_custom": ("served", "forward, then forward_backward with cross_entropy"),
        "get_console_url": ("client", "a URL of Tinker's own console"),
        "get_info": ("served", "POST get_info"),
        "get_telemetry": ("client", "the SDK's telemetry object"),
        "get_tokenizer": ("client", "loads the base model's tokenizer (get_info's tokenizer_id)"),
        "load_state": ("refused", "weights without their optimizer state"),
        "load_state_with_optimizer": ("served", "POST load_weights"),
        "optim_step": ("served", "POST optim_step"),
        "save_state": ("served", "POST save_weights"),
        "save_weights_and_get_sampling_client": ("served", "POST save_weights_for_sampler"),
        "save_weights_external": ("refused", "saving weights to external storage"),
        "save_weights_for_sampler": ("served", "POST save_weights_for_sampler"),
    },
    "SamplingClient": {
        "compute_logprobs": ("served", "POST asample (prompt_logprobs)"),
        "create": ("client", "how the SDK builds a sampling client"),
        "from_sampler_handle": ("client", "rebuilds a client from get_sampler_handle's string"),
        "get_base_model": ("served", "GET samplers/{id}"),
        "get_sampler_handle": ("client", "a string naming the sampling session"),
        "get_telemetry": ("client", "the SDK's telemetry object"),
        "get_tokenizer": ("client", "loads the base model's tokenizer"),
        "on_queue_state_change": ("client", "a callback the SDK calls"),
        "sample": ("served", "POST asample; cancel_future when the caller stops waiting"),
    },
    "RestClient": {
        "assign_session_project": ("refused", "projects and session traces"),
        "copy_weights": ("refused", "copying weights between runs"),
        "delete_checkpoint": ("served", "DELETE training_runs/{id}/checkpoints/{kind}/{name}"),
        "delete_checkpoint_from_tinker_path": ("served", "DELETE training_runs/{id}/checkpoints/{kind}/{name}"),
        "export_session_trace": ("refused", "projects and session traces"),
        "get_audit_log": ("refused", "audit logs and billing"),
        "get_billing_usage": ("refused", "audit logs and billing"),
        "get_current_checkpoint_storage_usage": ("refused", "audit logs and billing"),
        "get_external_weights_urls": ("refused", "download URLs of external weights"),
        "get_sampler": ("served", "GET samplers/{id}"),
        "get_server_capabilities": ("served", "GET get_server_capabilities"),
        "get_session": ("served", "GET sessions/{id}"),
        "get_telemetry": ("client", "the SDK's telemetry object"),
        "get_training_run": ("served", "GET training_runs/{id}"),
        "get_training_run_by_tinker_path": ("served", "GET training_runs/{id}"),
        "get_weights_info_by_tinker_path": ("served", "POST weights_info"),
        "list_checkpoints": ("served", "GET training_runs/{id}/checkpoints"),
        "list_sessions": ("served", "GET sessions"),
        "list_training_runs": ("served", "GET training_runs"),
        "list_user_checkpoints": ("served", "GET checkpoints"),
        "publish_checkpoint_from_tinker_path": ("refused", "publishing and unpublishing checkpoints"),
        "search_sessions": ("refused", "searching sessions"),
        "set_checkpoint_ttl_from_tinker_path": ("served", "PUT training_runs/{id}/checkpoints/{kind}/{name}/ttl"),
        "unpublish_checkpoint_from_tinker_path": ("refused", "publishing and unpublishing checkpoints"),
        "whoami": ("refused", "whoami requires JWT auth"),
    },
}


def sdk_classes() -> dict[str, type]:
    import tinker
    from tinker.lib.public_interfaces.rest_client import RestClient

    return {"ServiceClient": tinker.ServiceClient, "TrainingClient": tinker.TrainingClient,
            "SamplingClient": tinker.SamplingClient, "RestClient": RestClient}


def public_methods(cls: type) -> list[str]:
    return sorted(n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v))


def render() -> str:
    """The table docs/tinker.md holds: one row per public method (an `_async` twin is listed with its method)."""
    rows = ["| SDK method | | what the gateway does |", "|---|---|---|"]
    for cls, methods in SURFACE.items():
        for name, (verdict, note) in methods.items():
            twin = f", `{name}_async`" if name + "_async" in public_methods(sdk_classes()[cls]) else ""
            shown = {"served": "served", "refused": "**refused**", "client": "in the SDK"}[verdict]
            rows.append(f"| `{cls}.{name}`{twin} | {shown} | {note} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
