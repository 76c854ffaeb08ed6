"""The engine interface both inference engines implement, and its domain types.

An engine generates from token ids (prompts are tokenized before they reach
it, so every engine sees exactly the ids the caller is told about), reports
the weight version that produced each token (as spans), pauses in one of
three modes, and swaps in verified weights while paused. The service core
(`services.rollout.serving.core`) owns admission, the update gate and versions; an
engine only does what it is told.
"""

from __future__ import annotations

import abc
import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch

from flywheel.codec.identity import VersionIdentity
from flywheel.common.kept import KeptSet
from flywheel.common.provenance import VersionSpan
from flywheel.common.types import RAW, FinishReason, PauseMode, SampledDistribution, SamplingSpec
from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.probe import ProbeBatch, ProbeTolerance
from flywheel.transfer.broadcast import GroupSpec


@dataclass
class SampleOutput:
    """One finished completion."""

    index: int
    token_ids: list[int]
    #: Log-prob of each chosen token under the weights that sampled it.
    logprobs: list[float]
    #: Per position, (token id, log-prob) of the top alternatives, most likely first.
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: FinishReason
    #: The stop string or stop token id that ended the sample, as text; "" otherwise.
    stop_reason: str
    #: Weight version that produced the first token (the current one if none was produced).
    version_start: int
    #: Weight version that produced the last token.
    version_end: int
    #: The version that produced each token, as spans over `token_ids` (flywheel.common.provenance);
    #: empty when the engine could not tell (consumers then attribute every token to `version_start`).
    version_spans: list[VersionSpan] = field(default_factory=list)
    #: The distribution `logprobs` and `top_logprobs` are of.
    distribution: SampledDistribution = RAW
    #: When the spec asked (`SamplingSpec.prompt_logprobs`): log p(prompt[i + 1] | prompt[:i + 1]) for each i,
    #: len(prompt) - 1 of them, of the model's raw distribution, with the weights of `version_start`.
    prompt_logprobs: list[float] = field(default_factory=list)
    #: Where a cut (top-k, top-p, a grammar) applied, the sampler's kept set per completion position
    #: (flywheel.common.kept); empty when nothing was cut, or in raw log-probs mode.
    kept_sets: list[KeptSet] = field(default_factory=list)
    #: Mixture-of-experts models: the experts each router chose for every token fed to the model,
    #: [len(prompt) + len(tokens) - 1, L, K] in flywheel.models.moe's compact dtype; None: dense, or not recorded.
    routed_experts: torch.Tensor | None = None
    #: The identity of the LoRA adapter it was drawn with, as the service measured it (serving.adapters);
    #: b"": the base weights alone.
    adapter_identity: bytes = b""


@dataclass
class SequenceScores:
    """What the Score RPC returns for one given sequence (`Engine.score_tokens`)."""

    #: log p(ids[i + 1] | ids[:i + 1]) for each i, len(ids) - 1 of them, of the model's raw distribution.
    logprobs: list[float]
    #: Per scored position, (token id, log-prob) of the most likely tokens, most likely first; [] when not asked.
    top_logprobs: list[list[tuple[int, float]]]
    #: Weight version whose weights computed them.
    version: int


@dataclass
class Delta:
    """New tokens of one sample since its previous delta; `final` set on its last."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    final: SampleOutput | None = None


@dataclass(frozen=True)
class EngineLoad:
    """What the engine is busy with now."""

    running: int
    waiting: int
    kv_cache_usage: float


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class MemorySource:
    """Where a MEMORY version is, for an engine that pulls it itself (`Engine.pulls_memory`)."""

    #: The synchronizer's "host:port".
    address: str
    version: int
    #: Bearer token presented to the synchronizer (None: the process's own, if any).
    token: str | None = field(repr=False)
    #: Deadline of the whole pull, in seconds.
    timeout: float
    max_message_bytes: int
    #: Names this pull among the engine's staged versions (unique per update).
    ticket: str
    #: False: a source that cannot be reached fails at once (a nearby one, with the synchronizer after it).
    retry_unreached: bool = True


@dataclass(frozen=True)
class GroupSource:
    """An NCCL/gloo transfer the engine received itself, in its own process (`Engine.joins_groups`)."""

    group_id: str
    version: int
    #: Names the received version among the engine's staged versions.
    ticket: str


@dataclass
class StagedWeights:
    """A weight version, ready to be swapped in.

    Exactly one of `tensors` (verified CPU tensors in memory), `files`
    (safetensors files whose headers were checked) or `source` (a MEMORY
    version the engine pulls and verifies itself, or a transfer it received
    itself) is set. `release`, if set,
    is called once nothing reads `tensors` any more (their owner may then
    reuse them).
    """

    version: int
    tensors: dict[str, torch.Tensor] | None = None
    files: list[str] | None = None
    source: MemorySource | GroupSource | None = None
    nbytes: int = 0
    release: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    #: What the version is (its identity, from its manifest or the synchronizer): what the weights
    #: resident after the swap are verified against. None: unknown until the update asks for it.
    identity: VersionIdentity | None = None
    #: The trainer's probe of the version, where its manifest carried one.
    probe: ProbeBatch | None = None
    #: Of its staging, the seconds spent loading it into a copy of the engine's weights before the pause
    #: (`Engine.prepare_weights`; 0: the engine loads inside the pause).
    prepare_seconds: float = 0.0


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter an engine serves beside others on its one base (`Engine.add_adapter`): immutable,
    named by its identity. Read and verified by the service (services.rollout.serving.adapters)."""

    #: What requests name it by (`SamplingSpec.adapter`): its identity in hex.
    name: str
    #: flywheel.codec.identity of its tensors, computed over the bytes read from its files.
    identity: bytes
    #: Its peft directory (an engine that loads adapters itself, vLLM, reads the same files).
    path: str
    rank: int
    #: Per adapted module (its name in the model, e.g. "model.layers.0.self_attn.q_proj"): A [rank, in],
    #: B [out, rank] and the scale, so that the module computes base(x) + scale * x A^T B^T.
    layers: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]] = field(repr=False)
    nbytes: int = 0


@dataclass(frozen=True)
class LoadFaults:
    """FAULT INJECTION (`updates.faults_file`): what an engine's load does wrong on purpose, so that
    tests can prove an update's verification catches each class of loading bug. All off by default;
    the product never sets them."""

    #: (a) one element changed in a tensor the engine keeps readable, after loading.
    corrupt_readable: bool = False
    #: (b) a linear layer's weight scaled by this factor after loading (on vLLM's CPU path: the
    #: layer vLLM repacks, so that only a behavioural check can see it); 0: off.
    scale_linear: float = 0.0
    #: (c) two same-shaped tensors swapped by the loader (the name-mapping bug class).
    swap_same_shaped: bool = False
    #: (d) one tensor left at the previous version (a partial load).
    skip_one: bool = False
    #: (e) the load raises RuntimeError halfway.
    raise_halfway: bool = False

    @property
    def any(self) -> bool:
        return (self.corrupt_readable or bool(self.scale_linear) or self.swap_same_shaped or self.skip_one
                or self.raise_halfway)


NO_FAULTS = LoadFaults()


@dataclass(frozen=True)
class Measured:
    """What an engine measured of the weights it holds after a swap, by checkpoint name
    (flywheel.codec.identity tensor digests). An engine never reports a digest it did not compute."""

    #: RESIDENT: hashed as they sit in the engine now.
    resident: Mapping[str, bytes] = field(default_factory=dict)
    #: RECEIVED: hashed by the engine's loader as it consumed them, in the process that holds the
    #: model, during the last swap.
    received: Mapping[str, bytes] = field(default_factory=dict)
    #: Why some tensors could not be read back (in words; "" when all were).
    unreadable: str = ""


#: True while an update is staged for an engine that pulls MEMORY versions
#: itself: the MEMORY source then hands over `StagedWeights.source` instead of
#: pulling the bytes into this process (set by the service core, read by
#: `services.rollout.weights.sources`).
engine_pulls_memory: ContextVar[bool] = ContextVar("engine_pulls_memory", default=False)


class Engine(abc.ABC):
    """An inference engine behind the rollout service."""

    #: "vllm" or "transformers".
    kind: str
    #: Longest prompt + completion, in tokens.
    max_model_len: int
    #: Token ids are valid in [0, vocab_size).
    vocab_size: int
    #: Whether it enforces `SamplingSpec.constraint` (structured output) while sampling.
    supports_constraints: bool = False
    #: Whether it pulls MEMORY versions itself (staged with `source`, not `tensors`).
    pulls_memory: bool = False
    #: Which log-probs it returns (rollout config engine.logprobs; LogprobsMode).
    logprobs_mode: str = "processed"
    #: Whether it can return the other kind for a request that asks (`SamplingSpec.logprobs_mode`).
    logprobs_mode_per_request: bool = False
    #: Whether it scores prompts (`SamplingSpec.prompt_logprobs`, `SampleOutput.prompt_logprobs`).
    supports_prompt_logprobs: bool = False
    #: Whether it serves LoRA adapters beside one another (`add_adapter`, `SamplingSpec.adapter`).
    supports_adapters: bool = False

    def resolve(self, spec: SamplingSpec) -> SamplingSpec:
        """`spec` as this engine serves it (its log-probs named, `resolve_logprobs_mode`), or InvalidArgument
        for what it asks that this engine cannot honour."""
        if spec.prompt_logprobs and not self.supports_prompt_logprobs:
            raise InvalidArgument(f"sampling.prompt_logprobs: this {self.kind} engine does not score prompts")
        if spec.adapter is not None and not self.supports_adapters:
            raise FailedPrecondition(f"adapter: this {self.kind} engine serves no LoRA adapters")
        return self.resolve_logprobs_mode(spec)

    def resolve_logprobs_mode(self, spec: SamplingSpec) -> SamplingSpec:
        """`spec` with the log-probs it will get named, or InvalidArgument when it asks for the kind
        this engine does not return and, for its sampling settings, the two differ."""
        wanted = spec.logprobs_mode or self.logprobs_mode
        if wanted != self.logprobs_mode and not self.logprobs_mode_per_request and spec.logprobs_differ():
            raise InvalidArgument(
                f"sampling.logprobs_mode: {wanted} log-probs were asked for, but this {self.kind} engine returns "
                f"{self.logprobs_mode} ones (rollout config engine.logprobs)"
            )
        return replace(spec, logprobs_mode=wanted)

    @property
    def joins_groups(self) -> bool:
        """Whether it joins NCCL/gloo transfer groups itself (`receive_in_group`), rather than
        being handed tensors this process received."""
        return False

    async def receive_in_group(self, spec: GroupSpec, should_abort: Callable[[], bool]) -> StagedWeights:
        """Joins the transfer group as `spec`'s rank and stages what it broadcasts, verified
        (`flywheel.transfer.broadcast.receive`'s checks), without touching the live weights;
        returns StagedWeights with a `GroupSource`. Stops once `should_abort()` or when cancelled."""
        raise NotImplementedError(f"the {self.kind} engine does not join transfer groups")

    @abc.abstractmethod
    async def start(self) -> None:
        """Loads the model; slow (seconds to minutes)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Releases the model and any helper processes."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Weight version now being served."""

    @abc.abstractmethod
    def generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingSpec, *, stream: bool
    ) -> AsyncIterator[list[Delta]]:
        """Yields deltas as tokens arrive (stream) or only the final ones.

        Every sample's last delta carries `final`; the iterator ends after all
        n finals. Abandoning the iterator aborts the request.
        """

    @abc.abstractmethod
    async def pause(self, mode: PauseMode) -> None:
        """Stops generating. abort: in-flight requests end with "abort";
        wait: returns once they finished; keep: freezes them in place."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continues after pause (frozen requests go on)."""

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Running and waiting requests, KV-cache use."""

    @abc.abstractmethod
    def weight_specs(self) -> Mapping[str, TensorSpec]:
        """Names, dtypes and shapes an update must provide (the checkpoint's)."""

    async def prepare_weights(self, staged: StagedWeights, faults: LoadFaults = NO_FAULTS) -> StagedWeights:
        """Work done before generation pauses (e.g. pulling a `source`, sharing tensors with a worker,
        loading it into a copy of the model). `faults`: tests only (LoadFaults).

        May return `staged` itself or new StagedWeights; in the latter case
        nothing may read `staged.tensors` once this returns."""
        return staged

    @abc.abstractmethod
    async def swap_weights(self, staged: StagedWeights, faults: LoadFaults = NO_FAULTS) -> None:
        """Replaces the live weights and sets the version; the engine is paused. `faults`: tests
        only (LoadFaults).

        `staged` was verified against weight_specs, so this cannot fail on
        names, dtypes or shapes. `staged.tensors` are reused for the next
        update once the current one is over: copy out of them, or, when
        `staged.release` hands them back, trade them for tensors of the same
        names, dtypes and shapes (the engine's previous ones) in the same dict.
        """

    def host_weights(self) -> Mapping[str, torch.Tensor] | None:
        """The served weights as CPU tensors under the checkpoint's names, dtypes and shapes, read in
        place (no copy), to be the base of a delta pull; None when the engine holds them otherwise
        (another device or dtype, a fused layout, another process). Nothing may write them."""
        return None

    async def measure(self, names: Collection[str]) -> Measured:
        """What it can measure of the weights it holds (called after a swap, generation paused):
        the digests of every tensor it can read back as the checkpoint holds it (same dtype and
        shape), and those its loader hashed as it consumed them. Nothing, by default."""
        return Measured(unreadable=f"the {self.kind} engine cannot read its weights back")

    @property
    def probe_tolerance(self) -> ProbeTolerance:
        """The bound on the per-token log-prob differences (nats) between this engine's scores of the
        probe batch and the trainer's that still counts as the same weights, and the statistic it bounds
        (the largest, unless the engine's kernels are not the trainer's): engine numerics, measured per engine and dtype
        (docs/verification.md)."""
        return ProbeTolerance(1e-3)

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(ids[i + 1] | ids[:i + 1]) of each sequence under the resident weights, from the
        model's raw distribution (the probe). The engine must be running (not paused)."""
        return [list(final.prompt_logprobs) for final in await self._prefills(sequences)]

    async def score_tokens(self, sequences: Sequence[Sequence[int]], top_logprobs: int = 0) -> list[SequenceScores]:
        """The Score RPC's scores of given sequences (checked by the caller: ids in the vocabulary, each at
        least 2 tokens and within max_model_len), with the `top_logprobs` most likely tokens per position.
        By default a prefill through `generate` (no top tokens); an engine that returns them overrides this."""
        if top_logprobs:
            raise InvalidArgument(f"top_logprobs: the {self.kind} engine does not return the most likely tokens of "
                                  "given sequences; ask for 0")
        # The prefill's weights are those of its first (only) token's.
        return [SequenceScores(list(final.prompt_logprobs), [], final.version_start)
                for final in await self._prefills(sequences)]

    async def _prefills(self, sequences: Sequence[Sequence[int]]) -> list[SampleOutput]:
        """One greedy token after each sequence, its prompt scored: the final samples, in order."""
        if not self.supports_prompt_logprobs:
            raise FailedPrecondition(f"the {self.kind} engine does not score prompts")
        spec = SamplingSpec(max_tokens=1, temperature=0.0, prompt_logprobs=True)

        async def one(ids: Sequence[int]) -> SampleOutput:
            final = None
            async for deltas in self.generate(f"probe-{uuid.uuid4().hex[:12]}", list(ids), spec, stream=False):
                final = next((d.final for d in deltas if d.final is not None), final)
            if final is None or final.finish_reason not in ("stop", "length"):
                raise FailedPrecondition(f"the {self.kind} engine did not finish scoring a probe sequence "
                                         f"({final.finish_reason if final else 'no output'})")
            return final

        # Together: an engine that batches (vLLM) scores them in one prefill.
        return list(await asyncio.gather(*(one(ids) for ids in sequences)))

    async def add_adapter(self, adapter: AdapterWeights) -> None:
        """Makes `adapter` servable (requests whose spec names it sample with it), without pausing the
        requests running on the base or on other adapters."""
        raise FailedPrecondition(f"the {self.kind} engine serves no LoRA adapters")

    async def remove_adapter(self, name: str) -> None:
        """Unloads an adapter no request uses any more."""
        raise FailedPrecondition(f"the {self.kind} engine serves no LoRA adapters")

    async def discard_weights(self, staged: StagedWeights) -> None:
        """Releases what prepare_weights made, whether or not it was swapped in."""
