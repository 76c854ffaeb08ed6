"""Synchronizer service: tracks every component's state and moves versioned weights.

    python -m services.synchronizer                       # 127.0.0.1:50051, /metrics on 9091
    python -m services.synchronizer --server.port 0 --server.ready-file /tmp/sync.json
    python -m services.synchronizer --config deploy/synchronizer.yaml --print-config
"""

from flywheel.runtime.entry import run_main
from services.synchronizer.config import SynchronizerConfig

if __name__ == "__main__":
    run_main(
        service="synchronizer",
        config_cls=SynchronizerConfig,
        description=__doc__,
        build="services.synchronizer.app:build",
    )
