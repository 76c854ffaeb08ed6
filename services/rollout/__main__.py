"""Rollout service (Rollout-as-a-Service): generation for RL workers and agents.

    python -m services.rollout                            # 127.0.0.1:50053, /metrics on 9093
    python -m services.rollout --engine.model-path ./tiny-model --engine.args '{max_model_len: 512}'
    python -m services.rollout --config rollout.yaml --print-config
"""

from flywheel.runtime.entry import run_main
from services.rollout.config import RolloutConfig

if __name__ == "__main__":
    run_main(service="rollout", config_cls=RolloutConfig, description=__doc__, build="services.rollout.app:build")
