"""`python -m services.controller run CONFIG`: one RL job on this machine.

    python -m services.controller run examples/quickstart.yaml          # SmolLM2-135M, ~12 min on 2 CPU cores
    python -m services.controller run examples/quickstart-tiny.yaml     # tiny model, a minute or two
    python -m services.controller run CONFIG --run-dir runs/mine        # where logs, checkpoints, plots go
    python -m services.controller run CONFIG --max-steps 5              # override run.max_steps
    python -m services.controller run CONFIG --seed 2                   # run.seed 2, in runs/<run.name>-seed2

What happens, in order: the model is converted or built if missing, the
arithmetic dataset generated if missing, the synchronizer, trainer and
rollout services start as child processes on free 127.0.0.1 ports (each
logging to `<run dir>/<service>.log`; with `services:` addresses in the file
nothing is started and those are used), the controller's pipeline runs in
this process (its log: `<run dir>/controller.log`) with a live progress line,
and at the end `<run dir>/summary.json` and `progress.png` are written.

Stopping: Ctrl-C (or SIGTERM) asks the run to stop after a checkpoint; a
second one stops at once. Every child is stopped before this process exits,
and children die with it even if it is SIGKILLed (PR_SET_PDEATHSIG).

Healing (launch.restarts: how many, and a doubling backoff): a child service
that dies is started again: a rollout replica alone; the trainer or the
synchronizer by restarting every service and resuming from the last
checkpoint (the steps after it are redone, each task still trained once).
With `services:`, something else restarts them (the kubelet) and the run
catches up: a restarted synchronizer is handed the run's policy and the
trainer's weights, replicas rejoin by themselves, and a trainer that lost
its state rewinds the run to the last checkpoint: the synchronizer and the
replicas are rewound to its version too (they may hold versions made by the
lost weights), nothing restarted by hand. A synchronizer too old to rewind
must be restarted with the replicas instead (the console says which). Each
death is said on the console (`healing:`), the status page and in
summary.json (`restarts`). Out of restarts, a death ends the run: its name
and last log lines are printed and the exit status is 1; the same command
again resumes from the last checkpoint.

Containers: `FLYWHEEL_RUN__<SECTION>__<FIELD>` variables (YAML values)
override the run file's fields. `FLYWHEEL_RUN__SERVICES='{trainer: {address:
trainer:50052}, ...}'` (a `services:` section) makes the launcher use those
services instead of starting any; `FLYWHEEL_CONTROLLER__RUNS_DIR` is the
parent of run directories.

Resuming: the run directory defaults to `runs/<run.name>`, so running the same
command again continues from its last checkpoint (`resume: auto`, the
default; `resume: disable` starts over, `resume: {from_path: DIR}` picks one).

Exit status: 0 done, 1 failed (a service died, the run's error policy
stopped it, bad config), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PROG = "python -m services.controller run"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="run file (YAML): the run config plus an optional launch: section")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory; default run.output_dir or runs/<run.name>")
    p.add_argument("--max-steps", type=int, default=None, help="override run.max_steps")
    p.add_argument(
        "--seed", type=int, default=None,
        help="override run.seed (data order and sampling; the dataset and its held-out questions stay the same); "
        "the default run directory becomes runs/<run.name>-seed<N>, so seeds never resume each other",
    )
    p.add_argument(
        "--resume", choices=("auto", "disable"), default=None, help="override the file's resume setting"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Heavy imports (torch, grpc) only after --help has had its chance.
    from flywheel.runtime.config import ConfigError
    from services.controller.launcher.local_run import LocalRun

    from flywheel.runtime.entry import skip_teardown_collection

    try:
        return LocalRun.from_args(args).execute()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        skip_teardown_collection()  # a second of the launcher's exit; the services stopped already


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
