"""What the gateway's tests over real processes share (tests/integration/test_tinker_gateway.py,
test_tinker_surface.py): the tenants' keys, a gateway in-process on a real trainer (and rollout), LoRA
trainers, the untied tiny model, fixed data. The fixtures are imported by the test modules that use them."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from tinker import types

from flywheel.rollout.client import RolloutClient
from flywheel.runtime.auth import Scope, TokenScopes
from flywheel.runtime.http_server import HttpServer
from flywheel.trainer.client import TrainerClient
from services.tinker.config import TinkerConfig
from services.tinker.gateway import Gateway
from services.tinker.http_api import create_app
from services.tinker.tenants import TenantKeys
from tests.conftest import TEST_TOKEN

#: Tenant alice's and bob's keys; the services' own token and an agent's (neither opens the Tinker API).
KEY, BOB_KEY = "tml-test-alice-key", "tml-test-bob-key"
SERVICE_KEY, AGENT_KEY = "tml-test-service-key", "tml-test-agent-key"
TENANTS = {"alice": [KEY], "bob": [BOB_KEY]}
ADAPTED = '["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj","lm_head"]'

@contextlib.asynccontextmanager
async def gateway_on(trainer_address: str, checkpoints: Path, rollout_address: str = "", **settings):
    config = TinkerConfig(trainer_address=trainer_address, http_port=0, checkpoint_dir=checkpoints,
                          rollout_address=rollout_address, **settings)
    trainer = TrainerClient(trainer_address, token=TEST_TOKEN, timeout=120)
    rollout = RolloutClient(rollout_address, token=TEST_TOKEN, timeout=120) if rollout_address else None
    gateway = Gateway(config, trainer, rollout)
    await gateway.start()
    tokens = TokenScopes.of({Scope.SERVICE: [SERVICE_KEY], Scope.AGENT: [AGENT_KEY]}, TENANTS)
    http = HttpServer(create_app(gateway, TenantKeys(tokens)), "127.0.0.1", 0, name="tinker api")
    await http.start()
    try:
        yield gateway, f"http://127.0.0.1:{http.port}"
    finally:
        await http.stop()
        await gateway.close()
        await trainer.close()
        if rollout is not None:
            await rollout.close()


def start_lora_trainer(run_service, model: Path, checkpoints: Path, modules: str, *extra: str, env=None):
    process = run_service("trainer", "--model.path", str(model), "--checkpoint.dir", str(checkpoints),
                          "--model.lora.enabled", "true", "--model.lora.rank", "4", "--model.lora.target-modules", modules,
                          *extra, env=env)
    return process.grpc_address, checkpoints


@pytest.fixture
def lora_trainer(run_service, service_model: Path, tmp_path: Path):
    """Adapters where Tinker's defaults put them: attention, MLP and the output head."""
    return start_lora_trainer(run_service, service_model, tmp_path / "trainer-checkpoints", ADAPTED)


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model ties its output head to its input embeddings, as SmolLM2 does: an adapter on the head
    (Tinker's default) merges into a head of its own, which only an untied copy can serve (docs/tinker.md)."""
    from flywheel.models.tiny import build_tiny_model
    from flywheel.models.untie import untie_embeddings

    root = tmp_path_factory.mktemp("untied")
    return untie_embeddings(build_tiny_model(root / "tied", max_position_embeddings=512), root / "model")


@pytest.fixture
def lora_trainer_for_sampling(run_service, untied_model: Path, tmp_path: Path):
    return start_lora_trainer(run_service, untied_model, tmp_path / "trainer-checkpoints", ADAPTED)


def fixed_data() -> list[types.Datum]:
    """Two short supervised examples, their first target weighted 0 (a prompt token)."""
    out = []
    for tokens in ([11, 42, 77, 23, 56, 9], [101, 7, 88, 64]):
        targets = tokens[1:] + [5]
        weights = [0.0] + [1.0] * (len(tokens) - 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens),
                               loss_fn_inputs={"target_tokens": targets, "weights": weights}))
    return out



PROMPT = [11, 42, 77, 23]


#: The gateway's sampler as `flywheel up --with tinker` starts it: LoRA adapters side by side.
ADAPTERS = ("--adapters.max-resident", "4")


@pytest.fixture
def rollout(run_service, untied_model: Path):
    return run_service("rollout", "--engine.model-path", str(untied_model), "--engine.kind", "transformers",
                       "--http-port", "0", *ADAPTERS).grpc_address


@pytest.fixture
def merged_rollout(run_service, untied_model: Path):
    """A sampler that serves no adapters: the gateway installs merged weights on it, one version at a time."""
    return run_service("rollout", "--engine.model-path", str(untied_model), "--engine.kind", "transformers",
                       "--http-port", "0").grpc_address
