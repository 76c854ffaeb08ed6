"""The fallback engine: a transformers causal LM, decoded token by token.

Needs no vLLM, so it serves on any machine and keeps the API tests honest
about what is engine-specific. One worker thread owns the model: decode steps
and weight swaps both run on it, so a swap can never interleave with a step.
Sequences are stepped round-robin, one token each per round, up to
`max_num_seqs` at a time (the rest wait), each with its own KV cache.

It runs on CPU unless `engine.args.device` names another torch device
(e.g. "cuda:0"); sampling then reads each step's last-position logits on
the host (one vocabulary-sized copy per token).

Structured output (OpenAI response_format, forced tool calls) is enforced
with xgrammar, the backend vLLM uses (`hf_grammar`). Each sample records the
sampler's kept set where top-k/top-p or a grammar cut the vocabulary, and a
mixture-of-experts model's routing (flywheel.models.moe.Recorder): the
experts chosen for every token fed, for the trainer to replay.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flywheel.codec.checkpoint_dir import read_tensors
from flywheel.codec.identity import identify
from flywheel.common.kept import DEFAULT_MAX_IDS
from flywheel.models.moe import Recorder, RoutingShape, compact, routing_shape
from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.probe import ProbeTolerance
from services.rollout.engine.base import (
    NO_FAULTS, AdapterWeights, Delta, Engine, EngineLoad, LoadFaults, Measured, PauseMode, SamplingSpec, SequenceScores, StagedWeights,
    TensorSpec,
)
from services.rollout.engine.checkpoint import checkpoint_specs
from services.rollout.engine.faults import fault_targets
from services.rollout.engine.hf_scoring import score_sequence
from services.rollout.engine.hf_grammar import GrammarCompiler
from services.rollout.engine.hf_lora import AdapterHooks
from services.rollout.engine.hf_sequence import Sequence
from services.rollout.engine.text import TextCodec

log = logging.getLogger(__name__)

# Engine arguments this engine understands; the rest are vLLM's and ignored here.
_KNOWN_ARGS = {"device", "dtype", "max_model_len", "max_num_seqs", "seed", "tokenizer"}
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "half": torch.float16}


@dataclass
class _Request:
    request_id: str
    stream: bool
    seqs: list[Sequence]
    #: Its deltas as steps make them, or the exception its step failed with.
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    left: int = 0


class TransformersEngine(Engine):
    kind = "transformers"
    #: Structured output through xgrammar, as vLLM's (hf_grammar).
    supports_constraints = True
    #: Its sampler computes both kinds of log-probs at every step.
    logprobs_mode_per_request = True
    #: A sample's prefill computes the logits at every prompt position.
    supports_prompt_logprobs = True
    #: LoRA adapters applied by hooks, per sequence (hf_lora).
    supports_adapters = True

    def __init__(self, model_path: Path, args: Mapping[str, Any], codec: TextCodec, initial_version: int = 0) -> None:
        ignored = sorted(set(args) - _KNOWN_ARGS)
        if ignored:
            log.info("transformers engine ignores vLLM engine arguments", extra={"ignored": ignored})
        self._path = Path(model_path)
        self._args = dict(args)
        self._codec = codec
        self._version = initial_version
        self._max_num_seqs = int(args.get("max_num_seqs", 64))
        try:
            self._device = torch.device(str(args.get("device", "cpu")))
        except RuntimeError as exc:
            raise InvalidArgument(f"engine.args.device: {exc}") from None
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise FailedPrecondition(f"engine.args.device is {self._device}, but this machine has no CUDA device")
        self._seed = int(args.get("seed", 0))
        self._seed_counter = itertools.count()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hf-engine")
        self._requests: dict[str, _Request] = {}
        self._running: list[Sequence] = []
        self._waiting: deque[Sequence] = deque()
        self._paused = False
        self._draining = False
        self._step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.model: Any = None
        #: Kept sets of at most this many tokens are recorded with their ids (engine.max_kept_ids).
        self.max_kept_ids = DEFAULT_MAX_IDS
        #: Records the experts a mixture-of-experts model's routers choose; None for a dense model.
        self._routing: Recorder | None = None
        self._routing_shape: RoutingShape | None = None
        #: Compiles structured-output constraints (made at the first constrained request).
        self._grammars: GrammarCompiler | None = None
        #: The LoRA adapters resident beside the base weights (made at start).
        self._adapters: AdapterHooks | None = None

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.model = await loop.run_in_executor(self._executor, self._load_model)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(self._args.get("max_model_len") or getattr(config, "max_position_embeddings", 2048))
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if codec_eos := self._codec.eos_token_id:
            eos_ids.add(codec_eos)
        self._eos_ids = eos_ids
        named = self._args.get("dtype")
        self._specs = checkpoint_specs(self._path, next(self.model.parameters()).dtype if named else None)
        self._routing_shape = routing_shape(self.model)
        if self._routing_shape is not None:
            self._routing = Recorder(self.model).__enter__()
        state = self.model.state_dict()
        missing = [n for n in self._specs if n not in state]
        if missing:
            raise FailedPrecondition(f"checkpoint tensors not in the model: {missing[:5]}")
        self._adapters = AdapterHooks(self.model)
        self._loop_task = asyncio.create_task(self._run(), name="hf-engine-loop")

    def _load_model(self) -> Any:
        from transformers import AutoModelForCausalLM

        dtype = self._args.get("dtype", "auto")
        torch_dtype = _DTYPES.get(dtype, "auto") if isinstance(dtype, str) else dtype
        torch.manual_seed(self._seed)
        return AutoModelForCausalLM.from_pretrained(str(self._path), dtype=torch_dtype).to(self._device).eval()

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for request in list(self._requests.values()):
            self._finish_request(request, "abort")
        self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def version(self) -> int:
        return self._version

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running), waiting=len(self._waiting), kv_cache_usage=0.0)

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    # -- generation ------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingSpec, *, stream: bool
    ) -> AsyncIterator[list[Delta]]:
        if request_id in self._requests:
            raise FailedPrecondition(f"request id {request_id!r} is already running")
        grammars: list[Any] = [None] * sampling.n
        if sampling.constraint is not None:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self._codec.tokenizer, self.vocab_size, self._eos_ids)
            compiler, constraint = self._grammars, sampling.constraint
            grammars = await asyncio.to_thread(lambda: [compiler.matcher(constraint) for _ in range(sampling.n)])
        seqs = []
        for index in range(sampling.n):
            generator = torch.Generator()
            seed = sampling.seed * 1_000_003 + index if sampling.seed is not None else self._seed * 7919 + next(self._seed_counter)
            generator.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
            seqs.append(Sequence(request_id, index, list(prompt_ids), sampling, generator, self._eos_ids, self.max_model_len,
                                 max_kept_ids=self.max_kept_ids, grammar=grammars[index]))
        request = _Request(request_id, stream, seqs, left=len(seqs))
        self._requests[request_id] = request
        self._waiting.extend(seqs)
        self._wake.set()
        try:
            while request.left:
                deltas = await request.queue.get()
                if isinstance(deltas, Exception):  # its step failed (_fail_requests)
                    raise RuntimeError(f"generation failed in the engine: {deltas!r}") from deltas
                request.left -= sum(1 for d in deltas if d.final is not None)
                yield deltas
        finally:
            if self._requests.pop(request_id, None) is not None and request.left:
                # Abandoned by the caller: drop its sequences.
                for seq in seqs:
                    seq.end("abort")
                self._running = [s for s in self._running if s.request_id != request_id]
                self._waiting = deque(s for s in self._waiting if s.request_id != request_id)

    def _finish_request(self, request: _Request, reason: str) -> None:
        deltas = []
        for seq in request.seqs:
            if seq.finish is None:
                seq.end(reason)  # type: ignore[arg-type]
                delta = seq.delta(self._version, stream=request.stream)
                if delta is not None:
                    deltas.append(delta)
        if deltas:
            request.queue.put_nowait(deltas)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            async with self._step_lock:
                if not self._paused and not self._draining:
                    while self._waiting and len(self._running) < self._max_num_seqs:
                        self._running.append(self._waiting.popleft())
                if self._paused or not self._running:
                    if self._draining and not self._running:
                        self._drained.set()
                    self._wake.clear()
                    continue
                batch = list(self._running)
                version = self._version
                try:
                    await loop.run_in_executor(self._executor, self._step, batch, version)
                except Exception as exc:  # noqa: BLE001 - fails the step's requests, not the loop
                    # A loop that died here would leave these requests, and every later one, waiting
                    # for tokens forever, with nothing left to wake them.
                    log.exception("a generation step failed; its requests end with the error")
                    self._fail_requests({seq.request_id for seq in batch}, exc)
                    continue
                self._dispatch(batch, version)

    def _fail_requests(self, request_ids: set[str], error: Exception) -> None:
        """Ends these requests' sequences and raises `error` in their callers (`generate`)."""
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            for seq in request.seqs:
                seq.end("abort")
            request.queue.put_nowait(error)
        self._running = [s for s in self._running if s.request_id not in request_ids]
        self._waiting = deque(s for s in self._waiting if s.request_id not in request_ids)

    def _step(self, batch: list[Sequence], version: int) -> None:
        assert self._adapters is not None
        with torch.inference_mode():
            try:
                for seq in batch:
                    if seq.finish is not None:
                        continue
                    self._adapters.active = seq.spec.adapter
                    self._step_one(seq, version)
            finally:
                self._adapters.active = None  # scoring and probes run on the base weights

    def _step_one(self, seq: Sequence, version: int) -> None:
        prefill = seq.cache is None and not seq.out_ids  # the first; not a recompute after a swap
        recomputed = seq.cache is None
        ids = torch.tensor([seq.next_input()], dtype=torch.long, device=self._device)
        out = self.model(input_ids=ids, past_key_values=seq.cache, use_cache=True)
        seq.cache = out.past_key_values
        if self._routing is not None:
            seq.record_routing(compact(self._routing.take(), self._routing_shape), recomputed)
        if prefill and seq.spec.prompt_logprobs:
            seq.score_prompt(out.logits[0, :-1])
        seq.step(out.logits[0, -1].cpu(), self._codec, version)

    def _dispatch(self, batch: list[Sequence], version: int) -> None:
        per_request: dict[str, list[Delta]] = {}
        for seq in batch:
            request = self._requests.get(seq.request_id)
            if request is None:
                continue
            delta = seq.delta(version, stream=request.stream)
            if delta is not None:
                per_request.setdefault(seq.request_id, []).append(delta)
        for request_id, deltas in per_request.items():
            self._requests[request_id].queue.put_nowait(deltas)
        self._running = [s for s in self._running if s.finish is None]
        for seq in batch:
            if seq.finish is not None:
                seq.cache = None  # frees the KV cache now, not when the caller lets go

    async def score_tokens(self, sequences: list[list[int]], top_logprobs: int = 0) -> list[SequenceScores]:
        # On the model's thread and between steps (the step lock): a swap cannot land midway, so
        # every score is of the one version read there.
        loop = asyncio.get_running_loop()
        async with self._step_lock:
            return await loop.run_in_executor(self._executor, self._score, sequences, top_logprobs)

    def _score(self, sequences: list[list[int]], top_logprobs: int) -> list[SequenceScores]:
        with torch.inference_mode():
            return [SequenceScores(*score_sequence(self.model, ids, self._device, top_logprobs), self._version)
                    for ids in sequences]

    async def add_adapter(self, adapter: AdapterWeights) -> None:
        # On the model's thread, between two decode steps: no sequence pauses beyond that one slot.
        assert self._adapters is not None
        await asyncio.get_running_loop().run_in_executor(self._executor, self._adapters.add, adapter)

    async def remove_adapter(self, name: str) -> None:
        assert self._adapters is not None
        await asyncio.get_running_loop().run_in_executor(self._executor, self._adapters.remove, name)

    # -- pause and weights -----------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        if mode == "wait":
            self._drained.clear()
            self._draining = True
            self._wake.set()
            await self._drained.wait()
        async with self._step_lock:  # no step is running past this point
            self._draining = False
            self._paused = True
            if mode == "abort":
                for request in list(self._requests.values()):
                    self._finish_request(request, "abort")
                self._running.clear()
                self._waiting.clear()

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def prepare_weights(self, staged: StagedWeights, faults: LoadFaults = NO_FAULTS) -> StagedWeights:
        if staged.tensors is not None:
            return staged
        # Read before generation pauses, so the pause covers only the copy.
        tensors = await asyncio.to_thread(read_tensors, staged.files or [])
        return StagedWeights(version=staged.version, tensors=tensors, nbytes=staged.nbytes, identity=staged.identity,
                             probe=staged.probe)

    async def swap_weights(self, staged: StagedWeights, faults: LoadFaults = NO_FAULTS) -> None:
        loop = asyncio.get_running_loop()
        async with self._step_lock:
            try:
                await loop.run_in_executor(self._executor, self._copy_weights, staged, faults)
            finally:
                # Whatever was loaded (all of it, or part of it when the copy failed) is no longer the
                # old version: it is stamped with the new one, and the update's verification says what it is.
                self._version = staged.version
                for seq in [*self._running, *self._waiting]:
                    seq.cache = None  # frozen (keep mode) samples recompute their context

    def _copy_weights(self, staged: StagedWeights, faults: LoadFaults) -> None:
        """Installs the staged tensors. Staging tensors that are handed back for the next update
        (`staged.release`: a MEMORY pull's, updates.reuse_staging) are traded: a parameter they can
        stand in for (same dtype, shape and device, contiguous) takes the staged tensor in place of
        its own, and its previous tensor goes back in the staged dict, to be staged into next time:
        no copy while generation is paused. Everything else is copied."""
        tensors = staged.tensors if staged.tensors is not None else read_tensors(staged.files or [])
        params = dict(self.model.named_parameters(remove_duplicate=False)) if staged.release is not None else {}
        state = self.model.state_dict()
        targets = fault_targets(self._specs) if faults.any else None
        order = list(tensors)
        if targets is not None and faults.swap_same_shaped and targets.swapped is not None:
            log.warning("FAULT INJECTION: two same-shaped tensors swapped in the load", extra={"tensors": targets.swapped})
            a, b = targets.swapped
            order = [b if n == a else a if n == b else n for n in order]
        with torch.no_grad():
            for i, (name, source) in enumerate(zip(tensors, order)):
                if targets is not None and faults.raise_halfway and i == len(order) // 2:
                    log.warning("FAULT INJECTION: the load raises halfway", extra={"loaded": i})
                    raise RuntimeError(f"FAULT INJECTION: the load failed after {i} of {len(order)} tensors")
                if targets is not None and faults.skip_one and name == targets.skipped:
                    log.warning("FAULT INJECTION: one tensor left at the previous version", extra={"tensor": name})
                    continue
                tensor = tensors[source]
                param = params.get(name)
                if (source == name and param is not None and param.dtype == tensor.dtype
                        and param.shape == tensor.shape and param.device == tensor.device and tensor.is_contiguous()):
                    previous = param.data
                    param.data = tensor
                    tensors[name] = previous
                else:
                    state[name].copy_(tensor)
            state = self.model.state_dict()  # after the trades above: the tensors now live
            if targets is not None and faults.scale_linear:
                log.warning("FAULT INJECTION: a linear layer's weight scaled after the load",
                            extra={"tensor": targets.linear, "factor": faults.scale_linear})
                state[targets.linear].mul_(faults.scale_linear)
            if targets is not None and faults.corrupt_readable:
                log.warning("FAULT INJECTION: one element of a loaded tensor changed", extra={"tensor": targets.readable})
                flat = state[targets.readable].view(-1)
                flat[flat.numel() // 2] += 1

    def host_weights(self) -> Mapping[str, torch.Tensor] | None:
        # Only an update writes the weights, and updates run one at a time (RolloutCore): while the
        # next update's pull reads these on another thread, nothing writes them.
        state = self.model.state_dict()
        held = {}
        for name, spec in self._specs.items():
            t = state.get(name)
            if t is None or t.device.type != "cpu" or t.dtype != spec.dtype or tuple(t.shape) != tuple(spec.shape):
                return None
            held[name] = t.detach()
        return held

    async def measure(self, names: Collection[str]) -> Measured:
        # Read from the model itself, on its own thread (it owns the device): every name, as the
        # checkpoint holds it (the model loads in the checkpoint's dtypes unless engine.args.dtype says
        # otherwise: those tensors cannot be compared, and are named as unreadable).
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._measure, names)

    def _measure(self, names: Collection[str]) -> Measured:
        state = self.model.state_dict()
        readable = {n: state[n] for n in names
                    if n in state and n in self._specs and state[n].dtype == self._specs[n].dtype
                    and tuple(state[n].shape) == tuple(self._specs[n].shape)}
        missing = [n for n in names if n not in readable]
        why = f"{len(missing)} tensor(s) held in another dtype or shape than the checkpoint's" if missing else ""
        return Measured(resident=dict(identify(readable).tensors), unreadable=why)

    async def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The probe, on the model's own thread between two decode steps (not queued behind max_num_seqs
        requests like a generation: an update's verification must not wait for the batch to drain)."""

        def run() -> list[list[float]]:
            scores = []
            with torch.no_grad():
                for seq in sequences:
                    ids = torch.tensor([list(seq)], dtype=torch.long, device=self._device)
                    logits = self.model(input_ids=ids).logits[0, :-1].float()
                    chosen = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
                    scores.append(chosen.cpu().tolist())
            return scores

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    @property
    def probe_tolerance(self) -> ProbeTolerance:
        # The trainer's own model code and kernels: float32 scores agree to about 1e-6 nats, bfloat16 to 2e-3 (measured,
        # docs/verification.md); reduced precision moves every logit by its rounding, alike on both sides here.
        return ProbeTolerance(2e-4 if self.model.dtype == torch.float32 else 0.02)
