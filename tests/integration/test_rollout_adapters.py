"""LoRA adapters served beside one another by a real rollout server: each sample is drawn with
exactly the adapter its request names (the log-probs of peft's own forward of base + that adapter),
the base and other adapters' requests run alongside, an adapter whose files are not the identity
asked for is refused, and the least recently used one is evicted and reloaded when asked again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from flywheel.codec.identity import identify
from flywheel.common.v1 import common_pb2
from flywheel.models.tiny import build_tiny_model
from flywheel.models.untie import untie_embeddings
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from flywheel.runtime.client import open_channel
from tests.conftest import TEST_TOKEN
from tests.unit.rollout.rollout_helpers import (
    ServerThread,
    engine_args,
    need_engine,
    rollout_config,
)

ENGINES = ["transformers", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])]
PROMPT = [318, 268, 223, 20, 284, 223, 21, 33]
STEPS = 8
GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model: Path, out: Path, seed: int, rank: int = 4, head: bool = False) -> bytes:
    """A peft adapter of `model` with random A and B (a visible change), saved to `out`; its identity."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES + ["lm_head"] * head))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    peft.save_pretrained(str(out), save_embedding_layers=False)  # the adapter alone, as the trainer exports it
    return identify(load_file(str(out / "adapter_model.safetensors"))).digest


def peft_logprobs(model: Path, adapter: Path | None, tokens: list[int]) -> list[float]:
    """log p of `tokens` after PROMPT under peft's own forward of the base (+ `adapter`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    if adapter is not None:
        net = PeftModel.from_pretrained(net, str(adapter))
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = net(input_ids=ids).logits[0, len(PROMPT) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("adapters")
    # Untied, as the Tinker gateway serves it: an adapter on the output head changes the head alone.
    model = untie_embeddings(build_tiny_model(root / "tied"), root / "model")
    adapters = {name: (root / name, make_adapter(model, root / name, seed)) for seed, name in enumerate(["a", "b", "c"])}
    adapters["head"] = (root / "head", make_adapter(model, root / "head", seed=3, head=True))
    return {"root": root, "model": model, "adapters": adapters}


@pytest.fixture(scope="module", params=ENGINES)
def server(request: pytest.FixtureRequest, files: dict):
    need_engine(request.param)
    config = rollout_config(files["model"], request.param, engine={"args": engine_args(request.param)},
                            updates={"checkpoint_root": str(files["root"])}, adapters={"max_resident": 2})
    srv = ServerThread(config).start()
    srv.engine_kind = request.param
    yield srv
    srv.stop()


def stub(server) -> tuple[grpc.aio.Channel, pb_grpc.RolloutServiceStub]:
    channel = open_channel(server.address, token=TEST_TOKEN, default_timeout=120)
    return channel, pb_grpc.RolloutServiceStub(channel)


async def sample(rollout, adapter: tuple[Path, bytes] | None, sampling=GREEDY) -> common_pb2.Sample:
    ref = pb.Adapter(path=str(adapter[0]), identity=adapter[1]) if adapter else None
    response = await rollout.Generate(pb.GenerateRequest(
        prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT))], sampling=sampling, adapter=ref), timeout=120)
    return response.results[0].samples[0]


def metric(text: str) -> float:
    from prometheus_client import REGISTRY

    name, _, label = text.partition("{")
    labels = dict(kv.split("=") for kv in label.rstrip("}").replace('"', "").split(",")) if label else {}
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_each_request_samples_with_its_own_adapter_beside_the_others(server, files) -> None:
    channel, rollout = stub(server)
    async with channel:
        status = await rollout.GetStatus(pb.GetStatusRequest())
        assert status.max_resident_adapters == 2
        a, b = files["adapters"]["a"], files["adapters"]["b"]
        base, with_a, with_b = await asyncio.gather(sample(rollout, None), sample(rollout, a), sample(rollout, b))
        tol = 2e-4 if server.engine_kind == "transformers" else 2e-3
        for which, got, adapter in (("base", base, None), ("a", with_a, a), ("b", with_b, b)):
            expected = peft_logprobs(files["model"], adapter[0] if adapter else None, list(got.completion_token_ids))
            assert list(got.completion_logprobs) == pytest.approx(expected, abs=tol), which
            assert got.adapter_identity == (adapter[1] if adapter else b"")
            assert (got.weight_version_start, got.weight_version_end) == (0, 0)
        # The adapters change what is sampled (else the checks above would prove nothing).
        assert len({tuple(s.completion_token_ids) for s in (base, with_a, with_b)}) == 3
        # The base serves as before, with two adapters resident.
        assert list((await sample(rollout, None)).completion_token_ids) == list(base.completion_token_ids)


async def test_files_that_are_not_the_identity_asked_for_are_refused(server, files) -> None:
    channel, rollout = stub(server)
    async with channel:
        a = files["adapters"]["a"]
        # An identity this replica never loaded, asked for with another adapter's files.
        other = make_adapter(files["model"], files["root"] / f"other-{server.engine_kind}", seed=99)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await sample(rollout, (a[0], other))
        assert refused.value.code() == grpc.StatusCode.DATA_LOSS and "not the" in refused.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as outside:
            await sample(rollout, (Path("/etc"), a[1]))
        assert outside.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)
        with pytest.raises(grpc.aio.AioRpcError) as short:
            await sample(rollout, (a[0], a[1][:8]))
        assert short.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_least_recently_used_adapter_is_evicted_and_reloaded_on_demand(server, files) -> None:
    channel, rollout = stub(server)
    async with channel:
        a, b, c = (files["adapters"][n] for n in "abc")
        first = await sample(rollout, a)
        await sample(rollout, b)
        evictions, reloads = metric("flywheel_rollout_adapter_evictions_total"), \
            metric('flywheel_rollout_adapter_loads_total{kind="reload"}')
        await sample(rollout, c)  # two resident at most: a, the least recently used, goes
        assert metric("flywheel_rollout_adapter_evictions_total") == evictions + 1
        again = await sample(rollout, a)
        assert metric('flywheel_rollout_adapter_loads_total{kind="reload"}') == reloads + 1
        assert list(again.completion_token_ids) == list(first.completion_token_ids)
        assert again.adapter_identity == a[1]


async def test_an_adapter_of_the_output_head_is_served_where_the_engine_can(server, files) -> None:
    """The transformers engine adapts any linear layer, the output head too (the Tinker SDK's default,
    train_unembed); vLLM adapts none of its output head, and says so."""
    channel, rollout = stub(server)
    async with channel:
        head = files["adapters"]["head"]
        if server.engine_kind == "vllm":
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await sample(rollout, head)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "output head" in refused.value.details()
            return
        got = await sample(rollout, head)
        expected = peft_logprobs(files["model"], head[0], list(got.completion_token_ids))
        assert list(got.completion_logprobs) == pytest.approx(expected, abs=2e-4)
