"""gRPC adapters: the remote services behind the controller's Protocols.

`connect(config)` opens one channel per service named in the run config and
returns the `Services` a pipeline is built from. These are the only modules
of the controller's run that import grpc (besides the servicer).
"""

from __future__ import annotations

from flywheel.runtime.auth import resolve_token
from services.controller.adapters.health import GrpcHealthProbe
from services.controller.adapters.rollout import GrpcRolloutEngine
from services.controller.adapters.synchronizer import GrpcSynchronizer
from services.controller.adapters.teacher_grpc import GrpcTeacher
from services.controller.adapters.trainer import GrpcTrainer
from services.controller.assemble import TRAINER_PROBE, Services
from services.controller.run_config import RunConfig


def _registry_replicas(cfg: RunConfig, token: str | None, opened: list[GrpcRolloutEngine]):
    """Connects replicas as they register (rollouts/membership.py); each is added to `opened`, closed at the end."""
    s = cfg.services
    timeouts = {key: e.timeout_seconds for e in s.rollout for key in (e.id, e.address) if key}

    def connect_rollout(cid: str, address: str) -> tuple[GrpcRolloutEngine, GrpcHealthProbe]:
        timeout = timeouts.get(cid, timeouts.get(address, s.rollout_timeout_seconds))
        engine = GrpcRolloutEngine(address, token=token, timeout=timeout, name=cid)
        opened.append(engine)
        return engine, GrpcHealthProbe(cid, address)

    return connect_rollout


def connect(cfg: RunConfig, token: str | None = None) -> Services:
    s = cfg.services
    token = token or resolve_token(None, s.auth_token_file)
    trainer = GrpcTrainer(
        s.trainer.address, token=token, timeout=s.trainer.timeout_seconds,
        remove_previous_checkpoints=cfg.checkpoint.remove_previous,
        max_response_length=cfg.worker.sampling.max_tokens,
    )
    synchronizer = GrpcSynchronizer(s.synchronizer.address, token=token, timeout=s.synchronizer.timeout_seconds)
    # Replicas come from the synchronizer's registry (services.rollout only filters them); each is
    # added to `rollouts` as it registers, and closed at the end.
    rollouts: list[GrpcRolloutEngine] = []
    connect_rollout = _registry_replicas(cfg, token, rollouts)
    probes = [GrpcHealthProbe(TRAINER_PROBE, s.trainer.address), GrpcHealthProbe("synchronizer", s.synchronizer.address)]
    teacher = GrpcTeacher(cfg.algorithm.teacher, token=token) if cfg.algorithm.teacher is not None else None

    async def close() -> None:
        for client in (trainer, *rollouts, synchronizer, *([teacher] if teacher else [])):
            await client.close()

    return Services(
        trainer=trainer, rollouts=[], synchronizer=synchronizer, probes=probes, close=close,
        connect_rollout=connect_rollout, rollout_filter=[e.id or e.address for e in s.rollout],
        teacher=teacher.score if teacher is not None else None,
    )


__all__ = ["GrpcHealthProbe", "GrpcRolloutEngine", "GrpcSynchronizer", "GrpcTeacher", "GrpcTrainer", "connect"]
