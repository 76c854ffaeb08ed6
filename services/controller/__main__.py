"""Controller service: runs an RL job (data, rollouts, rewards, training, weight sync).

    python -m services.controller run examples/quickstart.yaml   # a whole job locally: starts the services, trains
    python -m services.controller run --help                     # the launcher's options
    python -m services.controller                                # the gRPC service: 127.0.0.1:50054, /metrics on 9094
    python -m services.controller --config controller.yaml --print-config
"""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        # The local launcher (services/controller/launcher/launch.py): same --help speed.
        from services.controller.launcher.launch import main

        sys.exit(main(sys.argv[2:]))

    from flywheel.runtime.entry import run_main
    from services.controller.config import ControllerConfig

    run_main(
        service="controller", config_cls=ControllerConfig, description=__doc__, build="services.controller.app:build"
    )
