"""Rollout service (Rollout-as-a-Service): generation for RL workers and agents.

    python -m services.rollout --engine.model-path ./tiny-model                # vLLM if installed, else transformers
    python -m services.rollout --engine.model-path ./tiny-model --engine.kind transformers --http-port 0
    python -m services.rollout --engine.model-path ./m --engine.args '{max_model_len: 1024, kv_cache_memory_bytes: 268435456}'
    python -m services.rollout --config rollout.yaml --print-config

gRPC on --server.port (default 50053: Generate, GenerateStream, Tokenize,
Detokenize, GetStatus, Pause, Resume, UpdateWeights), the OpenAI-compatible
HTTP API on --http-port (default 8000; /v1/models, /v1/completions,
/v1/chat/completions, /health, /metrics), Prometheus on --server.metrics-port.
With FLYWHEEL_AUTH_TOKEN set, both APIs want `Authorization: Bearer <token>`.
vLLM on CPU: keep its KV cache small (engine arg kv_cache_memory_bytes).
"""

from flywheel.runtime.entry import run_main
from services.rollout.config import RolloutConfig

if __name__ == "__main__":
    run_main(service="rollout", config_cls=RolloutConfig, description=__doc__, build="services.rollout.app:build")
