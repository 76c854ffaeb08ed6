"""Trainer service (Training-as-a-Service): learns from batches, saves, exports weights.

    python -m services.trainer                            # 127.0.0.1:50052, /metrics on 9092
    python -m services.trainer --model.path ./tiny-model --model.device cpu
    python -m services.trainer --config trainer.yaml --print-config
"""

from flywheel.runtime.entry import run_main
from services.trainer.config import TrainerConfig

if __name__ == "__main__":
    run_main(service="trainer", config_cls=TrainerConfig, description=__doc__, build="services.trainer.app:build")
