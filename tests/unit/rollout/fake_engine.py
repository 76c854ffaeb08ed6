"""TEST DOUBLE of an inference engine: deterministic tokens, controllable
timing, and the real engine contract for pause modes and weight swaps. It
lets the core's admission, gate and versioning be tested in milliseconds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import torch

from flywheel.codec.identity import VersionIdentity, identify
from flywheel.common.provenance import spans_of
from services.rollout.engine.base import (
    NO_FAULTS, Delta, Engine, EngineLoad, LoadFaults, Measured, PauseMode, SampleOutput, SamplingSpec, StagedWeights,
    TensorSpec,
)


class FakeEngine(Engine):
    kind = "fake"
    max_model_len = 512
    vocab_size = 1024

    def __init__(self, step_seconds: float = 0.001, tensors: tuple[str, ...] = ("w",),
                 readable: tuple[str, ...] | None = None) -> None:
        self.step_seconds = step_seconds
        self._version = 0
        self.weights = {name: torch.zeros(4) for name in tensors}
        #: The tensors it can read back as they sit (all by default); the others it can only hash as received.
        self.readable = tuple(tensors) if readable is None else readable
        self.received: dict[str, bytes] = {}
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
            # Each token's version, as a real engine records it (the token says it too: 100 + version).
            final = SampleOutput(0, ids, [-1.0] * len(ids), [], text, reason, "", start, self._version,
                                 version_spans=spans_of(token - 100 for token in ids))
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
        return {name: TensorSpec(torch.float32, (4,)) for name in self.weights}

    async def swap_weights(self, staged: StagedWeights, faults: LoadFaults = NO_FAULTS) -> None:
        assert staged.tensors is not None
        self.received = dict(identify(staged.tensors).tensors)
        names = list(self.weights)
        for i, name in enumerate(names):
            if faults.raise_halfway and i == len(names) // 2:
                self._version = staged.version
                raise RuntimeError("FAULT INJECTION: the load failed halfway")
            if faults.skip_one and name == names[-1]:
                continue
            self.weights[name].copy_(staged.tensors[name])
        if faults.scale_linear:
            self.weights[names[-1]].mul_(faults.scale_linear)
        if faults.corrupt_readable:
            self.weights[self.readable[0]][1] += 1
        self._version = staged.version
        self.swaps.append(staged.version)

    async def measure(self, names) -> Measured:
        resident = identify({n: self.weights[n] for n in names if n in self.readable}).tensors
        return Measured(dict(resident), {n: d for n, d in self.received.items() if n in names},
                        "" if len(resident) == len(self.weights) else "some tensors are repacked")

    # -- a probe: log-probs that depend on every weight ------------------------------

    supports_prompt_logprobs = False

    def fake_logprobs(self, ids) -> list[float]:
        """What this engine "scores" for a sequence: a function of every weight (the fake model)."""
        total = float(sum(t.sum() for t in self.weights.values()))
        return [-1.0 - 0.001 * total * (i + 1) for i in range(len(ids) - 1)]

    async def score(self, sequences) -> list[list[float]]:
        return [self.fake_logprobs(ids) for ids in sequences]


def identity_of(tensors: dict[str, torch.Tensor]) -> VersionIdentity:
    return identify(tensors)
