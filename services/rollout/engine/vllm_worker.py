"""Runs inside vLLM's worker process: registers Flywheel's weight-transfer
engine and gives the service a way to stage a version ahead of an update.

vLLM imports this class by name (`worker_extension_cls`) in its worker
process, before the worker builds its weight-transfer engine from the
factory, so importing this module is where the engine is registered
(`vllm_transfer.register`, idempotent). vLLM mixes the class into its worker,
so `collective_rpc("flywheel_stage", ...)` reaches the worker's engine.
Updates themselves go through vLLM's own API (start_weight_update,
update_weights, finish_weight_update).
"""

from __future__ import annotations

import atexit
from typing import Any

from flywheel.errors import FlywheelError
from flywheel.runtime.entry import skip_teardown_collection
from services.rollout.engine.vllm_transfer import FlywheelWeightTransferEngine, coded, register

register()
# vLLM's worker exits through the interpreter's teardown (2.6 s of a tiny model's rollout stop,
# measured on 2 cores): atexit handlers run before its collection.
atexit.register(skip_teardown_collection)


class FlywheelWorkerExtension:
    def _flywheel_engine(self) -> FlywheelWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, FlywheelWeightTransferEngine):
            raise RuntimeError("the worker's weight-transfer engine is not Flywheel's (weight_transfer_config.backend)")
        return engine

    def flywheel_stage(self, ticket: str, update_info: dict[str, Any]) -> None:
        """Starts pulling and verifying a version, or receiving it in a transfer group, under
        `ticket`, in the background."""
        try:
            self._flywheel_engine().stage(ticket, update_info)
        except FlywheelError as exc:
            raise RuntimeError(coded(exc.code, str(exc))) from exc  # vLLM's RPC keeps only the text

    def flywheel_prepare(self, ticket: str, faults: dict[str, Any]) -> None:
        """Starts loading the version staged under `ticket` into a twin of the model (see
        FlywheelWeightTransferEngine.prepare); `flywheel_staged` says when it is ready."""
        try:
            self._flywheel_engine().prepare(ticket, faults)
        except FlywheelError as exc:
            raise RuntimeError(coded(exc.code, str(exc))) from exc

    def flywheel_staged(self, ticket: str) -> dict[str, Any]:
        """Where the staging under `ticket` stands (see FlywheelWeightTransferEngine.staged)."""
        return self._flywheel_engine().staged(ticket)

    def flywheel_measure(self, names: list[str]) -> dict[str, Any]:
        """What this worker measured of the weights it holds (see FlywheelWeightTransferEngine.measure)."""
        return self._flywheel_engine().measure(names)

    def flywheel_drop(self, ticket: str) -> None:
        """Cancels or forgets the staging under `ticket`."""
        self._flywheel_engine().drop(ticket)
