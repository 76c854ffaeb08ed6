"""Controller service: runs an RL job (data, rollouts, rewards, training, weight sync).

    python -m services.controller                         # 127.0.0.1:50054, /metrics on 9094
    python -m services.controller --config controller.yaml --print-config
"""

from flywheel.runtime.entry import run_main
from services.controller.config import ControllerConfig

if __name__ == "__main__":
    run_main(
        service="controller", config_cls=ControllerConfig, description=__doc__, build="services.controller.app:build"
    )
