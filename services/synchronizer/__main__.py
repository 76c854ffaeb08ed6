"""Synchronizer service: tracks every component's state and moves versioned weights.

    python -m services.synchronizer                       # 127.0.0.1:50051, /metrics on 9091
    python -m services.synchronizer --server.port 0 --server.ready-file /tmp/sync.json
    python -m services.synchronizer --store-path /var/lib/flywheel/sync.sqlite3 \\
        --keep-versions 2 --lease-seconds 10 --rendezvous-port-min 29600 --rendezvous-port-max 29999
    python -m services.synchronizer --config deploy/synchronizer.yaml --print-config

With --store-path, component states, committed version metadata and the
policy survive a restart (weight bytes do not: trainers are asked to push
again). Clients: `flywheel.synchronizer.client.SynchronizerClient`.
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
