"""A trainer rank other than 0: `python -m services.trainer.rank`, started by the trainer service.

Rank 0 (the service process, `services.trainer.distributed.Ranks.start`)
writes the rank's config sections to its stdin as JSON and names the rank,
the world size and the rendezvous in the environment. The rank loads and
shards the same policy, then runs the commands rank 0 broadcasts until
"stop". A command that fails here fails the same way on rank 0, which
answers the caller; this process logs it and waits for the next.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def _exit_with_parent() -> None:
    """Ends this rank when the service that started it is gone (killed, crashed): it would
    otherwise wait for its next command until the collectives time out."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="rank-parent-watch", daemon=True).start()


def main() -> int:
    _exit_with_parent()
    from flywheel.runtime.logging import configure_logging
    from services.trainer.config import TrainerConfig
    from services.trainer.distributed import ENV_LOG, ENV_RANK
    from services.trainer.training import TrainingEngine

    level, fmt = os.environ.get(ENV_LOG, "INFO json").split()
    configure_logging(f"trainer-rank{os.environ[ENV_RANK]}", level, fmt)
    config = TrainerConfig.model_validate(json.loads(sys.stdin.read()))
    engine = TrainingEngine(config)
    engine.load()
    try:
        engine.serve_commands()
    finally:
        engine.close()
    from flywheel.runtime.entry import skip_teardown_collection

    skip_teardown_collection()
    return 0


if __name__ == "__main__":
    sys.exit(main())
