"""The trainer's probe of what it publishes: the log-probs of `flywheel.probe`'s sequences under
exactly the published weights (a plain float32 forward; LoRA: the merged tensors, not base +
adapters), sent with the version by every method and recorded by the synchronizer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from flywheel.codec import identify
from flywheel.common.v1 import common_pb2
from flywheel.probe import PROBE_LENGTH, PROBE_SEQUENCES, ProbeBatch, probe_sequences
from flywheel.synchronizer.client import SynchronizerClient
from services.synchronizer.embedded import embedded_synchronizer
from services.trainer.config import SyncConfig
from services.trainer.export import MANIFEST_FILE, WeightExporter, export_state
from services.trainer.probe import probe_logprobs, probe_token_ids, published_probe
from services.trainer.loss_request import LossRequest
from services.trainer.training import TrainingEngine
from tests.unit.trainer.trainer_helpers import make_batch


def step(engine: TrainingEngine) -> None:
    engine.train_step(make_batch(), LossRequest())


def plain_logprobs(model: torch.nn.Module, token_ids: list[list[int]]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) from the model's own forward, in float32."""
    ids = torch.tensor(token_ids)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def probe_now(engine: TrainingEngine, merge_lora: bool = False) -> ProbeBatch:
    policy = engine.policy
    policy.model.eval()
    try:
        return published_probe(policy, export_state(policy, merge_lora), merge_lora)
    finally:
        policy.model.train()


def test_the_probe_is_a_plain_float32_forward_of_the_published_weights(make_engine) -> None:
    engine = make_engine()
    step(engine)
    policy = engine.policy
    probe = probe_now(engine)
    ids = probe_sequences(min(policy.vocab_size, len(policy.tokenizer)) if policy.tokenizer else policy.vocab_size)
    assert [list(s) for s in probe.token_ids] == ids == probe_token_ids(policy)
    assert probe.tokens == PROBE_SEQUENCES * (PROBE_LENGTH - 1)
    policy.model.eval()
    expected = plain_logprobs(policy.model, ids)
    policy.model.train()
    assert torch.allclose(torch.tensor(probe.logprobs), expected, atol=1e-5, rtol=0)
    assert policy.model.training


def test_a_lora_policy_probes_the_merged_weights_it_publishes(make_engine, tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = make_engine(model={"lora": {"enabled": True, "rank": 4}})
    for _ in range(2):
        step(engine)  # the adapters' B starts at zero: a step makes the merge differ from the base
    merged = export_state(engine.policy, merge_lora=True)
    probe = probe_now(engine, merge_lora=True)
    # What a replica loading the published tensors holds: a plain model with exactly those.
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)  # tied to the embeddings
    plain.eval()
    ids = [list(s) for s in probe.token_ids]
    assert torch.equal(torch.tensor(probe.logprobs), torch.tensor(probe_logprobs(plain, ids, torch.device("cpu"))))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    assert not torch.allclose(torch.tensor(probe.logprobs), plain_logprobs(base, ids)), "the adapters count"
    # The live policy went on training with its adapters on, untouched by the swap.
    assert engine.policy.model.training and torch.equal(export_state(engine.policy, merge_lora=True)["model.embed_tokens.weight"],
                                                        merged["model.embed_tokens.weight"])


async def test_every_method_sends_the_probe_and_the_digests_with_the_version(make_engine, tmp_path: Path) -> None:
    from flywheel.synchronizer.participant import receive_version

    engine = make_engine(checkpoint={"allowed_roots": [str(tmp_path / "exports")]})
    async with embedded_synchronizer(checkpoint_root=tmp_path) as server, \
            SynchronizerClient(server.address) as client:
        exporter = WeightExporter(engine, SyncConfig(synchronizer_address=server.address, trainer_id="trainer-0"))

        step(engine)
        await exporter.memory()
        memory = await client.get_version(1)
        assert memory.probe == probe_now(engine) and memory.identity == identify(export_state(engine.policy, False))

        step(engine)
        result = await exporter.checkpoint(str(tmp_path / "exports"))
        checkpoint = await client.get_version(2)
        assert checkpoint.probe == probe_now(engine) and checkpoint.identity == identify(export_state(engine.policy, False))
        # In the directory too: a replica loading it without a synchronizer has the probe.
        written = common_pb2.WeightManifest.FromString((Path(result.path) / MANIFEST_FILE).read_bytes())
        assert ProbeBatch.from_pb(written.probe) == checkpoint.probe

        step(engine)
        await client.register("trainer", "trainer-0", address="127.0.0.1:1", capabilities=["nccl"])
        await client.register("rollout", "rollout-0", capabilities=["nccl"])
        group = await client.allocate_group(3, "trainer-0", ["rollout-0"], timeout_seconds=30, backend="gloo")
        receiver = {n: torch.zeros_like(t) for n, t in export_state(engine.policy, False).items()}
        await asyncio.gather(exporter.nccl(group.group_id), receive_version(client, "rollout-0", group, receiver))
        nccl = await client.get_version(3)
        assert nccl.probe == probe_now(engine) and nccl.identity == identify(receiver)


async def test_a_version_published_in_bfloat16_is_the_cast_weights_and_their_probe(make_engine, tiny_model: Path,
                                                                                   tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = make_engine(model={"publish_dtype": "bfloat16"})
    step(engine)
    published = export_state(engine.policy, False, torch.bfloat16)
    live = export_state(engine.policy, False)
    assert {t.dtype for t in published.values()} == {torch.bfloat16} and published.keys() == live.keys()
    assert all(t.dtype == torch.float32 for t in engine.policy.model.parameters()), "training stays in float32"
    probe = probe_now_cast(engine)
    # What a replica serving the version holds: the model in bfloat16 with exactly those tensors.
    served = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.bfloat16)
    served.load_state_dict(published, strict=False)
    served.eval()
    ids = [list(s) for s in probe.token_ids]
    assert torch.equal(torch.tensor(probe.logprobs), torch.tensor(probe_logprobs(served, ids, torch.device("cpu"))))
    assert probe != probe_now(engine), "the float32 weights' probe is another"
    async with embedded_synchronizer(checkpoint_root=tmp_path) as server, SynchronizerClient(server.address) as client:
        await WeightExporter(engine, SyncConfig(synchronizer_address=server.address, trainer_id="trainer-0")).memory()
        version = await client.get_version(1)
    assert version.identity == identify(published) and version.probe == probe
    assert version.identity != identify(live)


def probe_now_cast(engine: TrainingEngine) -> ProbeBatch:
    policy = engine.policy
    policy.model.eval()
    try:
        return published_probe(policy, export_state(policy, False, torch.bfloat16), False)
    finally:
        policy.model.train()


def test_publish_dtype_is_refused_where_it_is_not_done() -> None:
    import pytest
    from pydantic import ValidationError

    from services.trainer.config import TrainerConfig

    for refused in ({"lora": {"enabled": True}}, {}):
        data = {"model": {"publish_dtype": "bfloat16", **refused}}
        if not refused:
            data["parallel"] = {"shard": True}
        with pytest.raises(ValidationError, match="publish_dtype"):
            TrainerConfig.model_validate(data)
    assert TrainerConfig.model_validate({"model": {"publish_dtype": "float32"}, "parallel": {"shard": True}})
