"""TEST DOUBLE of an inference engine: deterministic tokens, controllable
timing, and the real engine contract for pause modes and weight swaps. It
lets the core's admission, gate and versioning be tested in milliseconds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import torch

from services.rollout.engine.base import Delta, Engine, EngineLoad, PauseMode, SampleOutput, SamplingSpec, StagedWeights, TensorSpec


class FakeEngine(Engine):
    kind = "fake"
    max_model_len = 512
    vocab_size = 1024

    def __init__(self, step_seconds: float = 0.001) -> None:
        self.step_seconds = step_seconds
        self._version = 0
        self.weights = {"w": torch.zeros(4)}
        self.running: dict[str, asyncio.Event] = {}
        self._aborted: set[str] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.swaps: list[int] = []
        #: Text of every sample (one token per character); default "x" per token.
        self.reply: str | None = None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingSpec, *, stream: bool) -> AsyncIterator[list[Delta]]:
        self.running[request_id] = asyncio.Event()
        try:
            await self._resumed.wait()
            start = self._version
            ids: list[int] = []
            steps = len(self.reply) if self.reply is not None else sampling.max_tokens
            for step in range(steps):
                await asyncio.sleep(self.step_seconds)
                await self._resumed.wait()
                if request_id in self._aborted:
                    break
                # The token tells which weights produced it.
                ids.append(100 + self._version)
                if stream:
                    yield [Delta(index=0, token_ids=ids[-1:], logprobs=[-1.0], text=self.reply[step] if self.reply else "x")]
            reason = "abort" if request_id in self._aborted else "stop" if self.reply is not None else "length"
            text = self.reply if self.reply is not None else "x" * len(ids)
            final = SampleOutput(0, ids, [-1.0] * len(ids), [], text, reason, "", start, self._version)
            yield [Delta(index=0, final=final)]
        finally:
            self.running.pop(request_id, None)
            self._aborted.discard(request_id)

    async def pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self._aborted |= set(self.running)
        elif mode == "wait":
            while self.running:
                await asyncio.sleep(0.001)
        if mode != "wait":
            self._resumed.clear()
        if mode == "abort":
            # Aborted requests still finish (with "abort") once they run again.
            self._resumed.set()
            while self.running:
                await asyncio.sleep(0.001)
            self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self.running), waiting=0, kv_cache_usage=0.0)

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return {"w": TensorSpec(torch.float32, (4,))}

    async def swap_weights(self, staged: StagedWeights) -> None:
        assert staged.tensors is not None
        self.weights["w"].copy_(staged.tensors["w"])
        self._version = staged.version
        self.swaps.append(staged.version)

    async def resident_digests(self, names) -> dict[str, bytes]:
        from flywheel.codec.identity import identify

        return dict(identify({n: self.weights[n] for n in names if n in self.weights}).tensors)

    async def corrupt_one_element(self) -> str:
        self.weights["w"][1] += 1
        return "w"
