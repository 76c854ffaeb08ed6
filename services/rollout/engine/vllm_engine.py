"""The default engine: vLLM's AsyncLLM in this process (its engine core in a
child process, as vLLM always runs it; on a CPU the model's worker inside that
child where one worker serves it: `vllm_cpu`), with weight updates through vLLM's
weight-transfer API and Flywheel's engine in its worker (`vllm_transfer`).

Versions come from vLLM itself: the engine core stamps every step's output
with the weight version we set after a swap, and each finished sample carries
its version spans, so the version reported for a token is the one that
produced it, even across a `keep` pause.

Weights reach the worker without a file. A MEMORY version is pulled and
verified by the worker itself, in the background while generation goes on
(`prepare_weights`); the swap, generation paused, only loads it. An
NCCL/gloo transfer is received by the worker too: it joins the
synchronizer's group as the replica's rank (`receive_in_group`) and holds
the version until the service, told COMMITTED, loads it by its ticket. With
tensor parallelism each worker holds a shard, and the synchronizer's group
has one rank per replica: this process then receives, and shares the
tensors with the workers in an anonymous memory file (memfd). A CHECKPOINT
directory's files are read by the worker where they lie.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import mmap
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flywheel import errors
from flywheel.common.kept import DEFAULT_MAX_IDS, KeptSet
from flywheel.common.types import SampledDistribution
from flywheel.errors import Aborted, FailedPrecondition, InvalidArgument
from flywheel.probe import ProbeStatistic, ProbeTolerance
from flywheel.runtime.tls import process_tls
from flywheel.transfer.broadcast import GroupSpec
from services.rollout.engine.base import (
    NO_FAULTS, AdapterWeights, Delta, Engine, EngineLoad, GroupSource, LoadFaults, Measured, MemorySource, PauseMode,
    SampleOutput, SamplingSpec, StagedWeights, TensorSpec,
)
from services.rollout.engine.checkpoint import checkpoint_specs
from services.rollout.engine.text import TextCodec
from services.rollout.engine.vllm_cpu import engine_core_environment, one_worker, spawned_with
from services.rollout.engine.vllm_outputs import SampleDeltas, prompt_logprobs, routed_experts, version_spans
from services.rollout.engine.vllm_sockets import use_private_socket_dir
from services.rollout.engine.vllm_transfer import BACKEND, decode_error, error_of

log = logging.getLogger(__name__)

WORKER_EXTENSION = "services.rollout.engine.vllm_worker.FlywheelWorkerExtension"
#: How often a staging in the worker is asked whether it is done, in seconds.
_POLL_SECONDS = 0.02
_ALIGN = 64


def _read_through(files: list[str]) -> None:
    buffer = bytearray(8 << 20)
    for file in files:
        with open(file, "rb", buffering=0) as fh:
            while fh.readinto(buffer):
                pass


@dataclass
class _SharedStaged(StagedWeights):
    """Tensors copied into an anonymous memory file the worker maps (no file in any directory)."""

    fd: int = -1
    layout: dict[str, Any] = field(default_factory=dict)


def _share(staged: StagedWeights) -> _SharedStaged:
    """Copies `staged.tensors` into a memfd (blocking; run it in a thread)."""
    assert staged.tensors is not None
    entries, size = [], 0
    for name, tensor in staged.tensors.items():
        entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), size])
        size += -(-tensor.nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create(f"flywheel-staged-v{staged.version}", os.MFD_CLOEXEC)
    try:
        if size:
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size) as region:
                for (_, _, _, offset), tensor in zip(entries, staged.tensors.values()):
                    if tensor.nbytes:
                        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                        torch.frombuffer(region, dtype=torch.uint8, count=flat.numel(), offset=offset).copy_(flat)
                        del flat
    except BaseException:
        os.close(fd)
        raise
    layout = {"pid": os.getpid(), "fd": fd, "size": size, "tensors": entries}
    return _SharedStaged(version=staged.version, nbytes=staged.nbytes, fd=fd, layout=layout)


def _worker_error(exc: BaseException) -> errors.FlywheelError | None:
    """The worker's FlywheelError behind a failed vLLM RPC (its status code kept), if it was one."""
    found = decode_error(str(exc))
    return error_of(*found) if found else None


def _checkpoint_dtype(path: Path) -> str:
    """The checkpoint's own dtype (config.json), or vLLM's "auto" when it names none."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    return str(config.get("dtype") or config.get("torch_dtype") or "auto")


def probe_tolerance(dtype: str) -> ProbeTolerance:
    """vLLM's scores of the probe against the trainer's transformers forward, measured per dtype
    (docs/verification.md, scripts/measure_probe_noise.py; 50 probes of 60 tokens on SmolLM2 each). Its
    kernels are not the trainer's, so single tokens stray where most agree, and the median of the 60 is held
    in both dtypes. float32: on correct weights the median stayed within 1.3e-5 nats while single tokens
    differed by up to 1.9e-3 (weights x1.01; 4e-4 on the largest, held until then, failed 4 correct probes
    in 50); one layer's weight x1.01 moved the median to 2.3e-3 and more. bfloat16 rounds
    every activation and the logits (a logit near 20 is held to 0.125): single tokens differed by up to 6.9
    nats while the median stayed within 0.092, and two swapped layers moved it to 1.10 and more. The
    records: bench/results/experiments/probe_noise.jsonl."""
    if dtype.endswith("float32"):
        return ProbeTolerance(2e-4, ProbeStatistic.MEDIAN)
    return ProbeTolerance(0.25, ProbeStatistic.MEDIAN)


class VllmEngine(Engine):
    kind = "vllm"
    supports_constraints = True
    #: vLLM's prompt_logprobs (its prefill's, of the raw distribution in either *_logprobs mode).
    supports_prompt_logprobs = True

    pulls_memory = True

    def __init__(
        self, model_path: Path, args: Mapping[str, Any], codec: TextCodec, initial_version: int = 0,
        reuse_staging: bool = True, logprobs_mode: str = "processed", prepare_outside_pause: bool = True,
        max_adapters: int = 0, max_adapter_rank: int = 64, cores: list[int] | None = None,
    ) -> None:
        for name in ("worker_extension_cls", "weight_transfer_config", "logprobs_mode", "enable_lora", "max_loras",
                     "max_lora_rank", "max_cpu_loras"):
            if name in args:
                raise InvalidArgument(f"engine.args.{name}: set by the rollout service; remove it")
        self._path = Path(model_path)
        #: engine.cpu_cores (None: not named), honoured on a CPU where the engine core is spawned (vllm_cpu).
        self._cores = cores
        self.logprobs_mode = logprobs_mode
        self._args = dict(args)
        self._codec = codec
        self._version = initial_version
        self._reuse_staging = reuse_staging
        #: Load each version into a twin of the model before the pause (vllm_load.prepare_twin).
        self._prepare = prepare_outside_pause
        self._stats: Any = None
        self._llm: Any = None
        self._active = 0  # requests between submission and their last output
        #: Requests in flight that carry their own seed (see _swap).
        self._seeded: set[str] = set()
        self._on_cpu = False
        #: Kept sets of at most this many tokens are recorded (engine.max_kept_ids), read from vLLM's
        #: processed top log-probs: asked for one more than that, a set is whole when fewer are finite.
        self.max_kept_ids = DEFAULT_MAX_IDS
        self._kept_probe = 0
        #: LoRA adapters (rollout config `adapters`): vLLM's own multi-LoRA, sized to what the service keeps
        #: resident; each resident adapter's LoRARequest by name.
        self._max_adapters, self._max_adapter_rank = max_adapters, max_adapter_rank
        self.supports_adapters = max_adapters > 0
        self._lora_requests: dict[str, Any] = {}
        self._lora_ids = itertools.count(1)

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class StatsTap(StatLoggerBase):
            """Keeps the scheduler's latest counts for GetStatus."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    engine._stats = scheduler_stats

            def log_engine_initialized(self) -> None:
                pass

        args = dict(self._args)
        # vLLM's "auto" dtype runs a float32 checkpoint in bfloat16 on CPU, and its
        # log-probs then disagree with the trainer's: serve the checkpoint's dtype
        # unless engine.args names one.
        args.setdefault("dtype", _checkpoint_dtype(self._path))
        if self._max_adapters:
            # The service decides what is resident (serving.adapters), and vLLM has room for all of them, on its
            # device and in its CPU cache alike, so it never evicts one on its own. One slot more than that stays
            # empty (slots fill lowest first): vLLM's CPU LoRA kernels pick a request's slot by indexing with its
            # LoRA index, -1 for a request without one, which selects the last slot. Empty, it adds nothing;
            # with every slot used, base requests batched beside adapters were measured sampling with the last
            # adapter (tests/integration/test_rollout_adapters.py).
            slots = self._max_adapters + 1
            args.update(enable_lora=True, max_loras=slots, max_cpu_loras=slots, max_lora_rank=self._max_adapter_rank)
        if self.logprobs_mode == "processed" and self.max_kept_ids:
            args.setdefault("max_logprobs", max(20, self.max_kept_ids + 1))
            self._kept_probe = min(self.max_kept_ids + 1, int(args["max_logprobs"]))
        try:
            # vLLM's processed_logprobs: after penalties, temperature, top-k and top-p (its sampler, on every
            # platform), the distribution each token was drawn from; engine-wide, so requests cannot switch.
            engine_args = AsyncEngineArgs(model=str(self._path), worker_extension_cls=WORKER_EXTENSION,
                                          weight_transfer_config={"backend": BACKEND},
                                          logprobs_mode=f"{self.logprobs_mode}_logprobs", **args)
        except TypeError as exc:
            raise InvalidArgument(f"engine.args: {exc}") from None
        use_private_socket_dir()
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        spawn_variables = engine_core_environment(self._cores, args) if self._on_cpu else {}

        def build() -> Any:
            with spawned_with(spawn_variables):
                return AsyncLLM.from_engine_args(engine_args, stat_loggers=[StatsTap])

        # Built off the event loop: it blocks until the engine core is up
        # (tens of seconds) and health must keep answering meanwhile.
        self._llm = await asyncio.to_thread(build)
        model_config = self._llm.vllm_config.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        # vLLM holds every floating weight in the model's dtype (the checkpoint's unless engine.args names one).
        self._specs = checkpoint_specs(self._path, model_config.dtype)
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        await self._llm.update_weight_version(str(self._version))

    async def stop(self) -> None:
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
            self._llm = None

    @property
    def version(self) -> int:
        return self._version

    def load(self) -> EngineLoad:
        stats = self._stats
        if stats is None:
            # Without vLLM's stats (engine arg disable_log_stats) only our own count is known.
            return EngineLoad(running=self._active, waiting=0, kv_cache_usage=0.0)
        return EngineLoad(
            running=int(stats.num_running_reqs), waiting=int(stats.num_waiting_reqs),
            kv_cache_usage=float(stats.kv_cache_usage),
        )

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    # -- generation ------------------------------------------------------------

    def _probe(self, spec: SamplingSpec) -> int:
        """How many processed top log-probs to ask for to see the kept set: 0 where nothing is cut."""
        if spec.temperature == 0 and spec.constraint is None:
            return 0
        cuts = 0 < spec.top_k or spec.top_p < 1.0 or spec.constraint is not None
        return self._kept_probe if cuts else 0

    def _params(self, spec: SamplingSpec, stream: bool) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        constraint = spec.constraint
        structured = StructuredOutputsParams(structural_tag=constraint.value) if constraint is not None else None

        return SamplingParams(
            n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
            max_tokens=spec.max_tokens, stop=list(spec.stop) or None, stop_token_ids=list(spec.stop_token_ids) or None,
            seed=spec.seed, logprobs=max(spec.top_logprobs, self._probe(spec)), min_tokens=spec.min_tokens,
            repetition_penalty=spec.repetition_penalty, ignore_eos=spec.ignore_eos,
            skip_special_tokens=spec.skip_special_tokens, structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            # 0: each prompt token's own log-prob, no alternatives. Such a request does not read the prefix cache
            # (vLLM's default for it): every prompt position is computed.
            prompt_logprobs=0 if spec.prompt_logprobs else None,
        )

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingSpec, *, stream: bool
    ) -> AsyncIterator[list[Delta]]:
        if self._llm is None:
            raise FailedPrecondition("the vLLM engine is not running")
        try:
            params = self._params(sampling, stream)
        except Exception as exc:
            # vLLM's own validation (VLLMValidationError, a ValueError in older releases), e.g. its
            # temperature range [0, 2]; the request's fault, so never an internal error.
            if isinstance(exc, ValueError) or type(exc).__name__ == "VLLMValidationError":
                raise InvalidArgument(f"sampling: {exc}") from None
            raise
        self._active += 1
        if sampling.seed is not None:
            self._seeded.add(request_id)
        try:
            # aclosing: an abandoned request reaches vLLM's abort at once, not at garbage collection.
            distribution = sampling.distribution(self.logprobs_mode)
            kept = (self._probe(sampling), sampling.constraint is not None)
            async with contextlib.aclosing(self._outputs(request_id, prompt_ids, params, sampling.top_logprobs,
                                                         distribution, kept, sampling.adapter)) as outputs:
                async for deltas in outputs:
                    yield deltas
        finally:
            self._active -= 1
            self._seeded.discard(request_id)

    async def _outputs(self, request_id: str, prompt_ids: list[int], params: Any, top_k: int,
                       distribution: SampledDistribution, kept: tuple[int, bool] = (0, False),
                       adapter: str | None = None) -> AsyncIterator[list[Delta]]:
        samples: dict[int, SampleDeltas] = {}
        lora = self._lora_requests[adapter] if adapter is not None else None
        async for output in self._llm.generate({"prompt_token_ids": prompt_ids}, params, request_id,
                                               lora_request=lora):
            deltas = []
            for completion in output.outputs:
                sample = samples.setdefault(completion.index, SampleDeltas(completion.index))
                if sample.done:
                    continue
                # Streamed, an output carries one sample's and only what is new; otherwise the one final output
                # carries all n samples and the whole prompt's (those of the sample that finished last).
                sample.prompt += output.prompt_logprobs or ()
                delta = self._delta(sample, completion, top_k, distribution, prompt_ids, kept)
                if delta.token_ids or delta.text or delta.final is not None:
                    deltas.append(delta)
            if deltas:
                yield deltas

    def _delta(self, sample: SampleDeltas, completion: Any, top_k: int, distribution: SampledDistribution,
               prompt_ids: list[int], kept: tuple[int, bool] = (0, False)) -> Delta:
        ids = list(completion.token_ids)
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        probe, constrained = kept
        for token, entry in zip(ids, completion.logprobs or ()):
            logprobs.append(float(entry[token].logprob))
            if probe:
                # Processed log-probs are -inf outside the kept set: fewer finite than asked is the whole set.
                finite = sorted(tid for tid, lp in entry.items()
                                if lp.rank and lp.rank <= probe and lp.logprob != -float("inf"))
                at = len(sample.ids) + len(logprobs) - 1
                if len(finite) < probe:
                    sample.kept.append(KeptSet(at, len(finite), tuple(finite), constrained))
                elif constrained:
                    # Too big to carry (its size at least this): flagged, for the controller to leave it out.
                    sample.kept.append(KeptSet(at, len(finite), (), True))
            if top_k:
                # Processed log-probs are -inf outside the kept set (tokens that could not be drawn): left out.
                ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entry.items()
                                 if lp.rank and lp.rank <= top_k and lp.logprob != -float("inf")))
                top.append([(tid, float(lp)) for _, tid, lp in ranked])
        sample.ids += ids
        sample.logprobs += logprobs
        sample.top += top
        sample.text += completion.text
        delta = Delta(index=sample.index, token_ids=ids, logprobs=logprobs, top_logprobs=top, text=completion.text)
        if completion.finish_reason is not None:
            sample.done = True
            marked = completion.weight_versions or []
            start = int(marked[0].version) if marked else self._version
            end = int(marked[-1].version) if marked else self._version
            spans = version_spans(marked, len(sample.ids))
            reason = completion.finish_reason if completion.finish_reason in ("stop", "length", "abort") else "error"
            stop = completion.stop_reason
            delta.final = SampleOutput(
                index=sample.index, token_ids=sample.ids, logprobs=sample.logprobs, top_logprobs=sample.top,
                text=sample.text, finish_reason=reason, stop_reason="" if stop is None else str(stop),
                version_start=start, version_end=end, version_spans=spans, distribution=distribution,
                prompt_logprobs=prompt_logprobs(sample.prompt, prompt_ids, reason in ("stop", "length")),
                kept_sets=list(sample.kept),
                routed_experts=routed_experts(getattr(completion, "routed_experts", None),
                                               len(prompt_ids) + len(sample.ids)),
            )
        return delta

    # -- pause and weights -----------------------------------------------------

    async def add_adapter(self, adapter: AdapterWeights) -> None:
        # vLLM reads the adapter's files itself: the same files the service verified against its identity.
        from vllm.lora.request import LoRARequest

        if self._llm is None:
            raise FailedPrecondition("the vLLM engine is not running")
        if head := [name for name in adapter.layers if name.split(".")[-1] == "lm_head"]:
            raise FailedPrecondition(f"adapter {adapter.name[:16]}: vLLM serves no LoRA on the output head ({head[0]}); "
                                     "train without one (the Tinker SDK's train_unembed=False) or serve it with the "
                                     "transformers engine")
        request = LoRARequest(adapter.name, next(self._lora_ids), adapter.path)
        try:
            await self._llm.add_lora(request)
        except Exception as exc:  # noqa: BLE001 - what vLLM cannot serve (a module it does not adapt, a rank)
            raise FailedPrecondition(f"adapter {adapter.name[:16]}: vLLM refuses it: {exc}") from None
        self._lora_requests[adapter.name] = request

    async def remove_adapter(self, name: str) -> None:
        request = self._lora_requests.pop(name, None)
        if request is not None and self._llm is not None:
            await self._llm.remove_lora(request.lora_int_id)

    async def pause(self, mode: PauseMode) -> None:
        # Frozen (keep) requests hold KV blocks; the caches are reset after a swap instead.
        await self._llm.pause_generation(mode=mode, clear_cache=mode != "keep")

    async def resume(self) -> None:
        await self._llm.resume_generation()

    @property
    def joins_groups(self) -> bool:
        # One rank per replica in the synchronizer's groups: one worker can take it.
        return one_worker(self._args)

    async def receive_in_group(self, spec: GroupSpec, should_abort: Callable[[], bool]) -> StagedWeights:
        """The worker joins the group and receives while generation goes on; returns once it holds
        the version (loaded later by its ticket, or dropped)."""
        source = GroupSource(spec.group_id, spec.version, uuid.uuid4().hex)
        nbytes = await self._staged_in_worker(source.ticket, {"group": asdict(spec)}, should_abort,
                                              f"transfer {spec.group_id}")
        return StagedWeights(version=spec.version, source=source, nbytes=nbytes)

    async def prepare_weights(self, staged: StagedWeights, faults: LoadFaults = NO_FAULTS) -> StagedWeights:
        if isinstance(staged.source, GroupSource):
            # The worker already holds it.
            return await self._prepared_in_worker(staged, faults) if self._prepare else staged
        if staged.source is not None:
            pulled = await self._stage_in_worker(staged.source)
            return await self._prepared_in_worker(pulled, faults) if self._prepare else pulled
        if staged.tensors is not None:
            # Before generation pauses: the copy into shared memory is the slow part.
            return await asyncio.to_thread(_share, staged)
        # The worker reads these files while generation is paused: bring
        # them into the page cache first, so the pause is not disk-bound.
        await asyncio.to_thread(_read_through, staged.files or [])
        return staged

    async def _stage_in_worker(self, source: MemorySource) -> StagedWeights:
        """The worker pulls and verifies the version while generation goes on; returns once it holds it."""
        tls = process_tls()
        info = {
            "synchronizer": source.address, "version": source.version, "token": source.token,
            "timeout_seconds": source.timeout, "max_message_bytes": source.max_message_bytes,
            "reuse_staging": self._reuse_staging, "retry_unreached": source.retry_unreached,
            "tls": {name: str(getattr(tls, name)) if getattr(tls, name) else None
                    for name in ("cert_file", "key_file", "client_ca_file", "ca_file")},
        }
        nbytes = await self._staged_in_worker(source.ticket, info, lambda: False, f"version {source.version}")
        return StagedWeights(version=source.version, source=source, nbytes=nbytes)

    async def _prepared_in_worker(self, staged: StagedWeights, faults: LoadFaults) -> StagedWeights:
        """The worker loads (and on CPU repacks) the staged version into a twin of its model while
        generation goes on; the swap then only commits it (updates.prepare_outside_pause)."""
        assert staged.source is not None
        started = time.monotonic()
        await self._in_worker("flywheel_prepare", staged.source.ticket, asdict(faults), lambda: False,
                              f"version {staged.version}")
        staged.prepare_seconds = time.monotonic() - started
        return staged

    async def _staged_in_worker(self, ticket: str, info: dict[str, Any], should_abort: Callable[[], bool],
                                what: str) -> int:
        """Has every worker stage `info` under `ticket` and waits until all hold it; returns its bytes."""
        return await self._in_worker("flywheel_stage", ticket, info, should_abort, what)

    async def _in_worker(self, method: str, ticket: str, argument: Any, should_abort: Callable[[], bool],
                         what: str) -> int:
        """Starts `method` on every worker for `ticket` and polls until all of them hold it ready; returns
        its bytes. A failure, an abort or a cancellation drops the ticket: the worker stops pulling,
        receiving or preparing (a receive's peers with it, through the group's store)."""
        try:
            await self._llm.collective_rpc(method, args=(ticket, argument))
            while True:
                if should_abort():
                    raise Aborted(f"{what} was aborted (while the worker staged it)")
                # One state per worker (tensor parallelism: each pulls the version and loads its shard).
                states = await self._llm.collective_rpc("flywheel_staged", args=(ticket,))
                for state in states:
                    if state["state"] == "failed":
                        raise error_of(state["code"], state["message"])
                if all(state["state"] == "ready" for state in states):
                    return int(states[0]["bytes"])
                await asyncio.sleep(_POLL_SECONDS)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._llm.collective_rpc("flywheel_drop", args=(ticket,)))
            if isinstance(exc, Exception) and (found := _worker_error(exc)) is not None:
                raise found from exc
            raise

    async def swap_weights(self, staged: StagedWeights, faults: LoadFaults = NO_FAULTS) -> None:
        # Once the worker starts loading it finishes, whatever becomes of this call: an abandoned
        # swap still ends with the version set to the weights the worker holds.
        swap = asyncio.ensure_future(self._swap(staged, faults))
        try:
            await asyncio.shield(swap)
        except asyncio.CancelledError:
            await swap
            raise

    async def _swap(self, staged: StagedWeights, faults: LoadFaults) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if staged.source is not None:
            info: dict[str, Any] = {"ticket": staged.source.ticket}
        elif isinstance(staged, _SharedStaged):
            info = {"shared": staged.layout}
        else:
            assert staged.files is not None, "prepare_weights shares tensors"
            info = {"files": list(staged.files)}
        if faults.any:
            info["faults"] = asdict(faults)
        await self._llm.start_weight_update()
        try:
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))
        except Exception as exc:
            # The worker has ended the update session itself. A failure before its load began left
            # the model untouched; one during the load left it holding no version: stamped with
            # the new number below, so that the update's verification and quarantine cover it.
            self._version = staged.version
            raise _worker_error(exc) or exc from exc
        await self._llm.finish_weight_update()
        if self._seeded and self._on_cpu:
            # vLLM on CPU cannot preempt a request that carries its own seed (its CPU generator has no
            # offset to rewind: the engine core dies), so a frozen seeded request ends aborted instead, to
            # be retried; the others go on.
            await self._llm.abort(sorted(self._seeded))
        # KV computed with the old weights must not be reused: frozen requests
        # are preempted (they recompute on resume) and the prefix cache emptied.
        await self._llm.reset_prefix_cache(reset_running_requests=True)
        await self._llm.update_weight_version(str(staged.version))
        self._version = staged.version

    async def measure(self, names: Collection[str]) -> Measured:
        # Each worker measures what it holds: with tensor or pipeline parallelism those are shards (never
        # the checkpoint's tensors, so nothing is RESIDENT), and every worker's loader took the whole
        # checkpoint tensors it needed: RECEIVED counts only digests every worker reported alike.
        if self._llm is None:
            return Measured(unreadable="the vLLM engine is not running")
        reports = await self._llm.collective_rpc("flywheel_measure", args=(list(names),))
        if len(reports) == 1:
            [only] = reports
            return Measured(dict(only["resident"]), dict(only["received"]), only["unreadable"])
        received = dict(reports[0]["received"])
        for report in reports[1:]:
            received = {n: d for n, d in received.items() if report["received"].get(n) == d}
        return Measured({}, received, f"{len(reports)} workers hold shards, not the checkpoint's tensors")

    @property
    def probe_tolerance(self) -> ProbeTolerance:
        return probe_tolerance(str(self._llm.vllm_config.model_config.dtype) if self._llm is not None else "")

    async def discard_weights(self, staged: StagedWeights) -> None:
        if staged.source is not None and self._llm is not None:
            # Cancels a pull still running there, or frees a version never swapped in.
            await self._llm.collective_rpc("flywheel_drop", args=(staged.source.ticket,))
        if isinstance(staged, _SharedStaged) and staged.fd >= 0:
            os.close(staged.fd)
            staged.fd = -1
