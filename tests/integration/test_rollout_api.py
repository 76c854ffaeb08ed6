"""The rollout service's gRPC and OpenAI HTTP APIs, on both engines.

One real `python -m services.rollout` process per engine for the whole module
(a vLLM engine takes 25 s or more to start on CPU); clients are the real gRPC
stubs and the official `openai` SDK. The last test stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from flywheel.common.v1 import common_pb2
from flywheel.errors import FlywheelError, InvalidArgument
from flywheel.launcher.processes import ServiceProcess, start_service
from flywheel.models.tiny import build_tiny_model
from flywheel.rollout.client import RolloutClient
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from flywheel.runtime.client import open_channel
from tests.conftest import TEST_TOKEN
from flywheel.runtime.http_server import http_ready_file
from tests.unit.rollout.rollout_helpers import engine_args, need_engine, reference_greedy, reference_logprobs

ENGINES = ["transformers", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])]
QUESTION = "What is 2 + 3? The answer is"
GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, top_logprobs=2)


#: The one core the engines compute on (engine.cpu_cores): a strict part of a machine with more shows the binding.
ENGINE_CORE = min(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rollout-api") / "model")


class Server:
    def __init__(self, child: ServiceProcess, kind: str) -> None:
        self.child, self.kind = child, kind
        self.address = child.grpc_address


@pytest.fixture(scope="module", params=ENGINES)
def server(request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    kind = request.param
    need_engine(kind)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_AUTH_TOKEN"] = TEST_TOKEN
    child = start_service("rollout", tmp_path_factory.mktemp(f"rollout-{kind}"), [
        "--engine.model-path", str(model_dir), "--engine.kind", kind, "--engine.args", json.dumps(engine_args(kind)),
        "--http-port", "0", "--limits.max-pending-requests", "64", "--server.shutdown-grace-seconds", "2",
        "--engine.cpu-cores", str(ENGINE_CORE),
    ], env)
    try:
        child.wait_ready(300)
        yield Server(child, kind)
    finally:
        child.stop()


def stub(channel: grpc.aio.Channel) -> pb_grpc.RolloutServiceStub:
    return pb_grpc.RolloutServiceStub(channel)


async def http_port(address: str) -> int:
    async with open_channel(address, token=TEST_TOKEN) as channel:
        return (await stub(channel).GetStatus(pb.GetStatusRequest())).http_port


async def test_generate_is_consistent_with_tokenize_and_the_policy(server, model_dir: Path) -> None:
    async with open_channel(server.address, token=TEST_TOKEN) as channel:
        rollout = stub(channel)
        status = await rollout.GetStatus(pb.GetStatusRequest())
        assert status.model_name == "model" and status.weight_version == 0 and not status.paused
        assert status.engine == server.kind and status.max_model_len == 256 and status.http_port > 0
        assert status.http_port == json.loads(http_ready_file(server.child.ready_path).read_text())["http_port"]
        ids = list((await rollout.Tokenize(pb.TokenizeRequest(text=QUESTION))).token_ids)
        chat = pb.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="What is 12 + 7?")])
        chat_ids = list((await rollout.Tokenize(pb.TokenizeRequest(messages=chat))).token_ids)
        response = await rollout.Generate(pb.GenerateRequest(
            prompts=[pb.Prompt(text=QUESTION, request_id="text"), pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
                     pb.Prompt(messages=chat, request_id="chat")],
            sampling=GREEDY))
        assert [r.request_id for r in response.results][::2] == ["text", "chat"]
        text, tokens, chat_result = (r.samples[0] for r in response.results)
        assert list(text.prompt_token_ids) == ids == list(tokens.prompt_token_ids)
        assert list(chat_result.prompt_token_ids) == chat_ids
        for sample in (text, chat_result):
            completion = list(sample.completion_token_ids)
            prompt = list(sample.prompt_token_ids)
            assert completion == reference_greedy(model_dir, prompt, 10)
            assert list(sample.completion_logprobs) == pytest.approx(reference_logprobs(model_dir, prompt, completion), abs=2e-3)
            assert [t.token_ids[0] for t in sample.top_logprobs] == completion
            assert sample.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert (sample.weight_version_start, sample.weight_version_end) == (0, 0)
            detok = await rollout.Detokenize(pb.DetokenizeRequest(token_ids=completion, skip_special_tokens=True))
            assert detok.text == sample.text
        assert list(tokens.completion_token_ids) == list(text.completion_token_ids)


def test_vllm_serves_the_model_in_its_engine_core_bound_to_the_named_cores(server) -> None:
    """On a CPU, vLLM's one worker runs inside its engine core (no third process: services/rollout/engine/
    vllm_cpu.py), every thread of it bound to the cores engine.cpu_cores names; the transformers engine runs
    in the service's own process."""
    import psutil  # a dependency of ours (pyproject.toml): missing, this fails rather than skips

    def spawned(process) -> list:  # multiprocessing's spawned children, not its resource tracker (vLLM may
        # retitle a child, "VLLM::EngineCore", and then its command line and environment cannot be read back)
        return [child for child in process.children()
                if not any("resource_tracker" in part for part in child.cmdline())]

    engines = spawned(psutil.Process(server.child.process.pid))
    if server.kind == "transformers":
        assert engines == []
        return
    assert len(engines) == 1, [child.cmdline() for child in engines]
    assert spawned(engines[0]) == [], "vLLM's worker runs in a process of its own"
    for thread in engines[0].threads():
        assert sorted(os.sched_getaffinity(thread.id)) == [ENGINE_CORE]


async def test_sampling_n_seed_and_stream(server) -> None:
    async with open_channel(server.address, token=TEST_TOKEN) as channel:
        rollout = stub(channel)
        sampling = common_pb2.SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=11, ignore_eos=True)
        request = pb.GenerateRequest(prompts=[pb.Prompt(text=QUESTION)], sampling=sampling)
        first = (await rollout.Generate(request)).results[0].samples
        again = (await rollout.Generate(request)).results[0].samples
        assert [s.index for s in first] == [0, 1, 2]
        assert [list(s.completion_token_ids) for s in first] == [list(s.completion_token_ids) for s in again]
        assert all(len(s.completion_logprobs) == len(s.completion_token_ids) == 8 for s in first)

        deltas: dict[int, list[int]] = {0: [], 1: []}
        finals = {}
        async for message in rollout.GenerateStream(pb.GenerateStreamRequest(
                prompt=pb.Prompt(text=QUESTION), sampling=common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True))):
            deltas[message.index] += list(message.token_ids)
            if message.HasField("final"):
                finals[message.index] = message.final
        assert set(finals) == {0, 1}
        for index, final in finals.items():
            assert list(final.completion_token_ids) == deltas[index] and len(deltas[index]) == 6


@pytest.mark.parametrize(
    ("request_msg", "field"),
    [
        (pb.GenerateRequest(sampling=GREEDY), "prompts:"),
        (pb.GenerateRequest(prompts=[pb.Prompt()], sampling=GREEDY), "prompts[0]:"),
        (pb.GenerateRequest(prompts=[pb.Prompt(text="")], sampling=GREEDY), "prompts[0].text: empty"),
        (pb.GenerateRequest(prompts=[pb.Prompt(text="hi")]), "sampling.max_tokens:"),
        (pb.GenerateRequest(prompts=[pb.Prompt(text="hi")], sampling=common_pb2.SamplingParams(max_tokens=4, top_p=2)), "sampling.top_p:"),
        (pb.GenerateRequest(prompts=[pb.Prompt(text="hi " * 300)], sampling=GREEDY), "prompts[0].text: the prompt is"),
        (pb.GenerateRequest(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=[3, -1]))], sampling=GREEDY), "prompts[0].token_ids[1]:"),
        (pb.GenerateRequest(prompts=[pb.Prompt(messages=pb.ChatMessages(messages=[common_pb2.ChatMessage(role="bot", content="x")]))],
                            sampling=GREEDY), "prompts[0].messages[0].role:"),
    ],
)
async def test_bad_generate_requests_are_invalid_argument(server, request_msg, field: str) -> None:
    async with open_channel(server.address, token=TEST_TOKEN, max_attempts=1) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub(channel).Generate(request_msg)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field), info.value.details()


async def test_invalid_utf8_and_backpressure_over_grpc(server) -> None:
    raw = pb.GenerateRequest(prompts=[pb.Prompt(text="MARK")], sampling=GREEDY).SerializeToString().replace(b"MARK", b"M\xffRK")
    async with open_channel(server.address, token=TEST_TOKEN, max_attempts=1) as channel:
        call = channel.unary_unary("/flywheel.rollout.v1.RolloutService/Generate", request_serializer=lambda b: b,
                                   response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(raw)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "prompts[0].text: not valid UTF-8"

        too_many = pb.GenerateRequest(prompts=[pb.Prompt(text="hi")] * 65, sampling=GREEDY)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub(channel).Generate(too_many)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 1000 <= int(dict(info.value.trailing_metadata())["retry-after-ms"]) <= 2000


async def test_pause_abort_returns_the_aborted_requests(server) -> None:
    long = common_pb2.SamplingParams(temperature=1.0, max_tokens=220, ignore_eos=True)
    async with open_channel(server.address, token=TEST_TOKEN, default_timeout=120) as channel:
        rollout = stub(channel)
        generation = asyncio.ensure_future(rollout.Generate(pb.GenerateRequest(
            prompts=[pb.Prompt(text=QUESTION, request_id=f"job-{i}") for i in range(3)], sampling=long)))
        while (await rollout.GetStatus(pb.GetStatusRequest())).running_requests == 0:
            await asyncio.sleep(0.01)
        paused = await rollout.Pause(pb.PauseRequest(mode=common_pb2.PAUSE_MODE_ABORT))
        assert sorted(paused.aborted_request_ids) == ["job-0", "job-1", "job-2"]
        results = (await generation).results
        assert all(r.samples[0].finish_reason == common_pb2.FINISH_REASON_ABORT for r in results)
        assert all(len(r.samples[0].completion_token_ids) < 220 for r in results)
        assert (await rollout.GetStatus(pb.GetStatusRequest())).paused
        held = asyncio.ensure_future(rollout.Generate(pb.GenerateRequest(prompts=[pb.Prompt(text="hi")], sampling=GREEDY)))
        await asyncio.sleep(0.3)
        assert not held.done()
        assert (await rollout.GetStatus(pb.GetStatusRequest())).waiting_requests >= 1
        await rollout.Resume(pb.ResumeRequest())
        sample = (await held).results[0].samples[0]
        assert sample.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(sample.completion_token_ids) == 10


async def test_openai_sdk_completes_chats_and_streams(server, model_dir: Path) -> None:
    port = await http_port(server.address)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TEST_TOKEN, max_retries=0)
    (model,) = (await client.models.list()).data
    assert model.id == "model"

    completion = await client.completions.create(model=model.id, prompt=QUESTION, max_tokens=6, temperature=0,
                                                 logprobs=2, extra_body={"ignore_eos": True})
    extra = completion.model_extra
    (choice,) = completion.choices
    assert choice.model_extra["token_ids"] == reference_greedy(model_dir, extra["prompt_token_ids"], 6)
    assert choice.logprobs.token_logprobs == pytest.approx(
        reference_logprobs(model_dir, extra["prompt_token_ids"], choice.model_extra["token_ids"]), abs=2e-3)
    assert len(choice.logprobs.top_logprobs[0]) == 2
    assert extra["weight_version"] == {"start": 0, "end": 0} and completion.usage.completion_tokens == 6

    many = await client.completions.create(model=model.id, prompt=[QUESTION, "Hello"], n=2, max_tokens=4,
                                           temperature=1.0, seed=3)
    assert [c.index for c in many.choices] == [0, 1, 2, 3] and len(many.model_extra["prompt_token_ids"]) == 2

    chat = await client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "What is 12 + 7?"}],
                                                max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                                extra_body={"ignore_eos": True})
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert len(choice.logprobs.content) == 5 and len(choice.logprobs.content[0].top_logprobs) == 3
    assert choice.model_extra["weight_version"] == {"start": 0, "end": 0, "spans": [[0, 0, 5]]}  # every token of version 0
    assert chat.model_extra["prompt_token_ids"] and len(choice.model_extra["token_ids"]) == 5

    stream = await client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, temperature=0, stream=True,
                                                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, tokens, usage = "", [], None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            tokens += chunk.choices[0].model_extra.get("token_ids", [])
        usage = chunk.usage or usage
    assert len(tokens) == 5 and usage.completion_tokens == 5
    direct = await client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert direct.choices[0].message.content == text and direct.choices[0].model_extra["token_ids"] == tokens

    streamed = await client.completions.create(model=model.id, prompt=QUESTION, max_tokens=4, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
    pieces = [c async for c in streamed]
    assert "".join(c.choices[0].text for c in pieces) == completion.choices[0].text[: len("".join(c.choices[0].text for c in pieces))]
    assert pieces[-1].choices[0].finish_reason == "length"

    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        await client.completions.create(model=model.id, prompt="hi", max_tokens=0)


async def test_typed_client(server) -> None:
    from flywheel.errors import InvalidArgument
    from flywheel.rollout.client import RolloutClient

    async with RolloutClient(server.address, token=TEST_TOKEN, timeout=120) as rollout:
        ids = await rollout.tokenize(QUESTION, add_special_tokens=True)
        chat = [{"role": "user", "content": "What is 12 + 7?"}]
        results = await rollout.generate([QUESTION, ids, chat], request_ids=["a", "b", "c"],
                                         max_tokens=5, temperature=0, ignore_eos=True)
        assert [list(r[0].prompt_token_ids) for r in results[:2]] == [ids, ids]
        assert list(results[2][0].prompt_token_ids) == await rollout.tokenize(chat)
        text = await rollout.detokenize(results[0][0].completion_token_ids, skip_special_tokens=True)
        assert text == results[0][0].text
        finals = [m.final async for m in rollout.generate_stream(ids, max_tokens=3, temperature=0, ignore_eos=True)
                  if m.HasField("final")]
        assert list(finals[0].completion_token_ids) == list(results[1][0].completion_token_ids)[:3]
        assert (await rollout.status()).weight_version == 0
        with pytest.raises(InvalidArgument, match="max_tokens") as info:
            await rollout.generate([ids], max_tokens=0)
        assert info.value.code == "INVALID_ARGUMENT"


async def test_prompt_log_probs_are_the_models_own_over_the_prompt(server, model_dir: Path) -> None:
    """SamplingParams.prompt_logprobs: each sample's prefill scores its prompt under the raw distribution (a
    plain transformers forward over it), whatever the sampling; the streamed final sample carries them too."""
    async with RolloutClient(server.address, token=TEST_TOKEN, timeout=120) as rollout:
        ids = await rollout.tokenize(QUESTION, add_special_tokens=True)
        expected = reference_logprobs(model_dir, ids[:1], ids[1:])
        [samples] = await rollout.generate([ids], n=2, temperature=0.7, top_p=0.8, max_tokens=3, seed=5,
                                           prompt_logprobs=True)
        finals = [m.final async for m in rollout.generate_stream(ids, max_tokens=2, prompt_logprobs=True)
                  if m.HasField("final")]
        [plain] = (await rollout.generate([ids], max_tokens=1))[0]
    for sample in [*samples, *finals]:
        got = list(sample.prompt_logprobs)
        print(f"{server.kind}: prompt log-probs, largest gap {max(abs(a - b) for a, b in zip(got, expected)):.2e}")
        assert got == pytest.approx(expected, abs=PROMPT_LOGPROBS_ABS[server.kind])
    assert len(finals) == 1 and list(plain.prompt_logprobs) == []


#: Largest gap to the reference allowed. Measured on the tiny model, float32, 2-core AMD EPYC: the transformers
#: engine's prefill is the reference's forward (0.0); vLLM-CPU's kernels, 4.8e-7.
PROMPT_LOGPROBS_ABS = {"transformers": 1e-6, "vllm": 1e-5}


async def test_score_is_the_prompt_log_probs_of_given_ids(server, model_dir: Path) -> None:
    """Score (prefill only): each sequence's log-probs equal a Generate's prompt log-probs of it and a plain
    transformers forward, version-stamped; top-k where the engine returns it; bad ids and shapes are
    INVALID_ARGUMENT, more than the limits RESOURCE_EXHAUSTED, before anything runs."""
    async with RolloutClient(server.address, token=TEST_TOKEN, timeout=120) as rollout:
        ids = await rollout.tokenize(QUESTION, add_special_tokens=True)
        short = ids[:4]
        scored, scored_short = await rollout.score([ids, short])
        [[sample]] = await rollout.generate([ids], max_tokens=1, prompt_logprobs=True)
        expected = reference_logprobs(model_dir, ids[:1], ids[1:])
        assert list(scored.logprobs) == pytest.approx(list(sample.prompt_logprobs), abs=PROMPT_LOGPROBS_ABS[server.kind])
        assert list(scored.logprobs) == pytest.approx(expected, abs=PROMPT_LOGPROBS_ABS[server.kind])
        assert list(scored_short.logprobs) == pytest.approx(expected[:3], abs=PROMPT_LOGPROBS_ABS[server.kind])
        assert scored.weight_version == scored_short.weight_version == 0 and not scored.top_logprobs
        if server.kind == "transformers":
            (top,) = await rollout.score([ids], top_logprobs=3)
            assert list(top.logprobs) == list(scored.logprobs) and len(top.top_logprobs) == len(ids) - 1
            for alternatives, given in zip(top.top_logprobs, scored.logprobs):
                assert len(alternatives.token_ids) == 3 and list(alternatives.logprobs) == sorted(alternatives.logprobs, reverse=True)
                assert alternatives.logprobs[0] >= given  # the given token is never likelier than the likeliest
        else:  # vLLM's prompt log-probs carry no alternatives here yet: refused, not left empty
            with pytest.raises(InvalidArgument, match="top_logprobs: the vllm engine"):
                await rollout.score([ids], top_logprobs=3)
        for sequences, top, code, match in [
            ([[5]], 0, "INVALID_ARGUMENT", r"sequences\[0\].ids: 1 token"),
            ([ids, [5, 10**6]], 0, "INVALID_ARGUMENT", r"sequences\[1\].ids\[1\]: token id 1000000"),
            ([[5] * 300], 0, "INVALID_ARGUMENT", "context holds 256"),
            ([], 0, "INVALID_ARGUMENT", "at least one sequence"),
            ([ids], 99, "INVALID_ARGUMENT", "top_logprobs: must be between 0 and 20"),
            ([[5, 6]] * 257, 0, "RESOURCE_EXHAUSTED", "at most 256"),
        ]:
            with pytest.raises(FlywheelError, match=match) as info:
                await rollout.score(sequences, top_logprobs=top)
            assert info.value.code == code


async def test_metrics_then_sigterm_stops_cleanly(server) -> None:
    port = await http_port(server.address)
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read())
    assert health["status"] == "ok"
    metrics = urllib.request.urlopen(server.child.metrics_url, timeout=5).read().decode()
    for family in ("flywheel_rollout_generated_tokens_total", "flywheel_rollout_prompt_tokens_total",
                   "flywheel_rollout_weight_version 0.0", 'flywheel_rollout_rejected_requests_total{reason="queue_full"} 1.0'):
        assert family in metrics, family
    server.child.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(server.child.process.wait, 60) == 0
    assert '"msg": "stopped"' in server.child.log_path.read_text()
