"""The rollout engine that tests and bench smokes give the tiny quickstart where the engine is not
what they check.

The quickstart's `engine.kind: auto` picks vLLM where it is installed. On two cores vLLM takes
25-30 s to start (and seconds to stop), the transformers engine 4; a test of the controller, the
synchronizer or the launcher's healing starts the services once or more, so the difference is most
of its time. The quickstart's own tests, the engines' tests and one case per subject keep vLLM.
"""

from __future__ import annotations

from typing import Any

#: vLLM arguments that mean the same to the transformers engine; it refuses the others (vLLM's cache
#: and compilation settings), as every engine refuses what it does not honour.
CARRIED_ARGS = ("max_model_len", "max_num_seqs", "seed", "dtype")


def with_transformers_engine(run: dict[str, Any]) -> dict[str, Any]:
    """`run` (a quickstart run file's data) with its launched rollout on the transformers engine,
    keeping the arguments that engine shares with the one it had. Changes `run` in place."""
    rollout = run.setdefault("launch", {}).setdefault("rollout", {})
    engine = rollout.get("engine") or {}
    args = {k: v for k, v in (engine.get("args") or {}).items() if k in CARRIED_ARGS}
    rollout["engine"] = {**engine, "kind": "transformers", "args": args}
    return run
