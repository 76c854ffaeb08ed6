"""Test helpers for the rollout service: a server on its own thread, engine
settings that keep vLLM-on-CPU small, a transformers reference, and the
product synchronizer on a thread of its own (for a rollout configured with
its address once per test module)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from flywheel.runtime.server import RunningServer, serve
from services.rollout.config import RolloutConfig
from tests.conftest import TEST_TOKEN

# A fixed small KV cache (64 MiB holds 64k tokens of the tiny model): the
# default touches GiBs at start-up on a machine other processes share.
VLLM_ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=64, kv_cache_memory_bytes=64 * 2**20,
                 enforce_eager=True, seed=0)
HF_ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=64, seed=0)


def engine_args(kind: str) -> dict[str, Any]:
    return dict(VLLM_ARGS if kind == "vllm" else HF_ARGS)


def rollout_config(model: Path, kind: str, **overrides: Any) -> RolloutConfig:
    data: dict[str, Any] = {
        "server": {"port": 0, "metrics_port": 0, "auth_token": TEST_TOKEN, "shutdown_grace_seconds": 1},
        "http_port": 0,
        "engine": {"kind": kind, "model_path": str(model), "args": engine_args(kind)},
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return RolloutConfig.model_validate(data)


def need_engine(kind: str) -> None:
    """Skips when the engine's package is missing."""
    if kind == "vllm":
        import pytest

        pytest.importorskip("vllm")


class LoopThread:
    """An event loop running on a thread of its own. A server started there outlives each
    test's event loop (pytest-asyncio gives every test a fresh one), so a module-scoped fixture
    can start it once, before the rollout that is configured with its address."""

    def __init__(self, name: str = "test-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        """Runs `coro` on the loop and returns its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        if not self._thread.is_alive():
            self.loop.close()


@contextlib.contextmanager
def synchronizer_thread(**fields: Any) -> Iterator[Any]:
    """The product synchronizer (`embedded_synchronizer`, the test token required; `fields`:
    SynchronizerConfig fields) served on a `LoopThread` until the block exits."""
    from services.synchronizer.embedded import embedded_synchronizer

    loop = LoopThread("synchronizer")
    serving = embedded_synchronizer(server={"auth_token": TEST_TOKEN}, **fields)
    try:
        sync = loop.run(serving.__aenter__())
        try:
            yield sync
        finally:
            loop.run(serving.__aexit__(None, None, None))
    finally:
        loop.close()


class ServerThread:
    """The rollout service served by `flywheel.runtime.server.serve` on its own
    thread and event loop, so tests in any loop (or none) can call it."""

    def __init__(self, config: RolloutConfig) -> None:
        from services.rollout.app import build

        self.config = config
        self.spec = build(config)
        self.running: RunningServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="rollout-server", daemon=True)

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def on_ready(running: RunningServer) -> None:
                self.running = running
                self._ready.set()

            await serve(self.spec, self.config.server, stop=self._stop, on_ready=on_ready)

        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self._error = exc
        finally:
            self._ready.set()

    def start(self, timeout: float = 300.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("rollout server not ready")
        if self._error is not None or self.running is None:
            raise RuntimeError("rollout server failed to start") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(120)

    @property
    def address(self) -> str:
        assert self.running is not None
        return f"127.0.0.1:{self.running.grpc_port}"


def reference_logprobs(model_dir: Path, prompt: Sequence[int], completion: Sequence[int],
                       state: dict[str, torch.Tensor] | None = None) -> list[float]:
    """Log-probs of `completion` after `prompt` under a plain transformers forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(logprobs[start + i, t]) for i, t in enumerate(completion)]


def reference_greedy(model_dir: Path, prompt: Sequence[int], steps: int,
                     state: dict[str, torch.Tensor] | None = None) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def probe_of(model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> Any:
    """The trainer's probe (flywheel.probe) of `state` (default: the model directory's own weights): what a
    trainer publishes with a version, for tests that publish versions by hand. An engine that cannot read
    every tensor back (vLLM on CPU) proves a version only with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flywheel.probe import ProbeBatch, probe_sequences
    from services.trainer.probe import probe_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)
    model.eval()
    vocab = min(model.get_input_embeddings().weight.shape[0], len(AutoTokenizer.from_pretrained(str(model_dir))))
    ids = probe_sequences(vocab)
    return ProbeBatch.of(ids, probe_logprobs(model, ids, torch.device("cpu")))


def write_checkpoint(directory: Path, state: dict[str, torch.Tensor], version: int, model_dir: Path) -> Path:
    """A CHECKPOINT version as a trainer writes one: the safetensors file and its weight manifest, with the
    trainer's probe of `state` (an engine that cannot read every tensor back proves the version by it)."""
    from safetensors.torch import save_file

    from flywheel.codec import build_manifest
    from services.rollout.weights.verify import MANIFEST_FILE

    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    manifest = build_manifest(state, version)
    manifest.probe.CopyFrom(probe_of(model_dir, state).to_pb())
    (directory / MANIFEST_FILE).write_bytes(manifest.SerializeToString())
    return directory
