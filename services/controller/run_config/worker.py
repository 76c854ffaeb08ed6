"""How a run's episodes are played: the `worker` section (its sampling, tools, and the environment
services an OpenEnv or verifiers worker plays in)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from flywheel.runtime.config import StrictModel


class SamplingConfig(StrictModel):
    temperature: float = Field(1.0, ge=0, description="softmax temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass")
    top_k: int = Field(-1, description="top-k cut-off; -1 disables")
    max_tokens: int = Field(256, ge=1, description="completion length limit, in tokens")
    stop: list[str] = Field(default_factory=list, description="stop strings")
    seed: int | None = Field(None, description="sampling seed")


class ToolConfig(StrictModel):
    name: str = Field(description="name the model calls the tool by")
    function: str = Field(description="'module:attr' of a sync or async Python function")
    description: str = Field("", description="shown to the model")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}}, description="JSON schema of the arguments"
    )


class EnvironmentConfig(StrictModel):
    """An OpenEnv environment server (worker.type openenv, services/controller/workers/environment.py):
    one session an episode over its WebSocket path (/ws): reset, then a step per model turn, the
    model's text as the action, until the environment says done."""

    url: str = Field(description="http(s):// (or ws(s)://) root of the environment server; its sessions are at /ws")
    prompt_field: str = Field(
        "prompt", description="the observation's field shown to the model: the first user message after reset, "
        "and each later observation as the next user turn"
    )
    action_field: str = Field("message", description="the action's field the model's reply goes into")
    reset_fields: list[str] = Field(
        default_factory=list, description="fields of the task's row passed to reset, besides seed (the row's "
        "`seed`, else one drawn from its split and index: every episode of a group gets the same) and episode_id"
    )
    observation_template: str = Field(
        "\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n",
        description="text a later observation is rendered as, with {observation} (ChatML's user turn by default); "
        "never trained"
    )
    timeout_seconds: float = Field(60.0, gt=0, description="deadline of one reset or step, in seconds")
    connect_timeout_seconds: float = Field(10.0, gt=0, description="deadline of opening a session, in seconds")
    max_concurrency: int = Field(64, ge=1, description="sessions open at once")


class VerifiersConfig(StrictModel):
    """A verifiers environment (worker.type verifiers, services/controller/workers/verifiers.py): its
    episodes are played by the verifiers host (services/controller/adapters/verifiers_host.py), which the
    controller starts in verifiers' own virtual environment unless `url` names one you run."""

    taskset: str | None = Field(
        None, description="id of the verifiers taskset (an installed package, or one in `path`) the host plays; "
        "each task is the run's data row validated into its TaskData (the row's `prompt`, else data's prompt_key)"
    )
    taskset_args: dict[str, Any] = Field(default_factory=dict, description="the taskset's config fields")
    harness: str = Field("null", description="the verifiers harness the model runs in (null: verifiers' plain chat "
                         "loop, which needs no container); the runtime is verifiers' subprocess runtime")
    path: list[str] = Field(default_factory=list, description="directories put on the host's import path (a "
                            "taskset package that is not installed)")
    url: str | None = Field(None, description="http(s) URL of a verifiers host you started yourself; then the "
                            "controller starts none (taskset, when given, must be the one it serves)")
    python: str | None = Field(
        None, description="interpreter of the virtual environment verifiers is installed in; default: "
        ".venv-verifiers beside the controller's (.venv), which make setup makes"
    )
    max_concurrency: int = Field(32, ge=1, description="episodes the host plays at once")
    startup_timeout_seconds: float = Field(120.0, gt=0, description="how long the host may take to serve")


class WorkerConfig(StrictModel):
    type: str = Field(
        "simple", description="simple | math | agent | external (your own openai-SDK agent, see worker.agent) | "
        "openenv (an OpenEnv environment server, see worker.env) | verifiers (a verifiers environment, see "
        "worker.verifiers) | 'module:Class' of your own worker"
    )
    group_size: int = Field(4, ge=1, description="completions per task (the GRPO group)")
    max_in_flight: int = Field(32, ge=1, description="tasks rolled out concurrently")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling of training rollouts")
    chat: bool = Field(True, description="send text prompts as a user chat message (chat template applied)")
    system_prompt: str | None = Field(None, description="system message prepended to chat prompts")
    instruction: str | None = Field(
        None,
        description="math: text appended to every question; default the worker's own (asks for step-by-step "
        "reasoning and a \\boxed{} answer), '' for none",
    )
    max_turns: int = Field(4, ge=1, description="agent, openenv: assistant turns per episode")
    env: EnvironmentConfig | None = Field(None, description="openenv: the environment server the episodes run in")
    verifiers: VerifiersConfig | None = Field(None, description="verifiers: the verifiers environment the episodes "
                                              "are played in")
    tools: list[ToolConfig] = Field(default_factory=list, description="agent: tools the model may call")
    tool_result_template: str | None = Field(
        None, description="agent: text a tool result is rendered as, with {result}; default ChatML tool turn"
    )
    tool_timeout_seconds: float = Field(60.0, gt=0, description="agent: limit of one tool call, in seconds")
    agent: str | None = Field(
        None, description="external: the agent, 'package.module:function' or 'path/to/file.py:function' called as "
        "function(task, base_url, api_key) (async, or sync run in a thread; returns the reward or None), or the "
        "http(s) URL of your agent service, POSTed {task, base_url, api_key, session_id} and answering {reward}"
    )
    agent_timeout_seconds: float = Field(
        300.0, gt=0, description="external, verifiers: limit of one episode, in seconds (past it the task is retried)"
    )
    session_ttl_seconds: float | None = Field(
        None, gt=0, description="external, verifiers: how long a replica keeps an episode's session and its "
        "records, in seconds; default agent_timeout_seconds + 60"
    )
    max_retries: int = Field(3, ge=0, description="re-rollouts of one task before it is recorded as failed")
    timeout_seconds: float = Field(600.0, gt=0, description="limit of one rollout step, in seconds")
