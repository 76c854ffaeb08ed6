"""LoRA adapters served beside one another: loaded on first use, verified, the least recently used evicted.

A request names an adapter by its directory and its identity (`AdapterRef`).
The identity is what the adapter is: the replica reads the directory's tensors,
computes their identity (flywheel.codec.identity) itself, and serves them only
if it is the one asked for, so a sample is never drawn with bytes other than
the ones named, whoever wrote the directory. An adapter is immutable: resident
under its identity, it is never reloaded while resident, and two requests of
the same identity share it.

At most `adapters.max_resident` are loaded at once. A request for one that is
not loaded evicts the least recently used adapter that no running request
uses (waiting, when every resident one is in use, for one to be free). Loads
and evictions are counted (metrics.ADAPTER_LOADS: "reload" is one that was
evicted before). Loading one never pauses the requests of others: the engine
installs it beside them (`Engine.add_adapter`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from flywheel.codec.checkpoint_dir import read_tensors
from flywheel.codec.identity import IDENTITY_BYTES, identify
from flywheel.errors import DataLoss, FailedPrecondition, InvalidArgument
from flywheel.runtime.paths import confine
from services.rollout import metrics
from services.rollout.config import AdaptersConfig
from services.rollout.engine.base import AdapterWeights, Engine

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: peft's names: <prefix><module>.lora_A.weight, <prefix><module>.lora_B.weight.
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterRef:
    """An adapter a request asks for: where its files are, and what they must be."""

    path: str
    identity: bytes

    @property
    def name(self) -> str:
        return self.identity.hex()


def read_adapter(directory: Path, identity: bytes, max_rank: int) -> AdapterWeights:
    """The adapter in peft's layout at `directory`, if its tensors are `identity` (DATA_LOSS otherwise)."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"adapter {directory}: no readable {CONFIG_FILE} ({exc})") from None
    plain = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {},
             "alpha_pattern": {}}
    refused = [key for key, value in plain.items() if config.get(key, value) not in (value, None)]
    if config.get("bias", "none") != "none":
        refused.append("bias")
    if refused:
        raise FailedPrecondition(f"adapter {directory}: {', '.join(refused)} of {CONFIG_FILE} are not served "
                                 "(plain LoRA on linear layers only)")
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", 0))
    if not 1 <= rank <= max_rank:
        raise FailedPrecondition(f"adapter {directory}: rank {rank} is outside [1, {max_rank}] (adapters.max_rank)")
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    tensors = read_tensors([directory / WEIGHTS_FILE])
    measured = identify(tensors).digest
    if measured != identity:
        raise DataLoss(f"adapter {directory}: its tensors are identity {measured.hex()}, not the {identity.hex()} "
                       "asked for")
    halves: dict[str, dict[str, object]] = {}
    for key, tensor in tensors.items():
        for half in ("A", "B"):
            suffix = f".lora_{half}.weight"
            if key.startswith(_PREFIX) and key.endswith(suffix):
                halves.setdefault(key[len(_PREFIX):-len(suffix)], {})[half] = tensor
                break
        else:
            raise FailedPrecondition(f"adapter {directory}: tensor {key} is not a LoRA A or B of a linear layer")
    layers = {}
    for module, pair in halves.items():
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape[0] != rank or b.shape[1] != rank:  # type: ignore[union-attr]
            raise FailedPrecondition(f"adapter {directory}: {module} lacks its A or B, or they are not of rank {rank}")
        layers[module] = (a, b, scale)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return AdapterWeights(identity.hex(), identity, str(directory), rank, layers, nbytes)  # type: ignore[arg-type]


class AdapterCache:
    """The adapters resident on one engine (see the module doc)."""

    def __init__(self, config: AdaptersConfig, root: Path | None) -> None:
        self.config = config
        self.root = root
        #: name -> requests using it; in least-recently-used-first order.
        self._resident: OrderedDict[str, int] = OrderedDict()
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._evicted: set[str] = set()
        self._changed = asyncio.Condition()
        metrics.ADAPTERS_RESIDENT.set_function(lambda: len(self._resident))

    def check(self, ref: AdapterRef) -> Path:
        """`ref`'s directory, or the error for a request that cannot be served."""
        if not self.config.max_resident:
            raise FailedPrecondition("adapter: this replica serves no LoRA adapters (adapters.max_resident is 0)")
        if len(ref.identity) != IDENTITY_BYTES:
            raise InvalidArgument(f"adapter.identity: {IDENTITY_BYTES} bytes are needed, got {len(ref.identity)}")
        return confine(ref.path, [self.root] if self.root else [], "adapter.path")

    @asynccontextmanager
    async def use(self, engine: Engine, ref: AdapterRef) -> AsyncIterator[str]:
        """Holds `ref` resident on `engine` (loading it first if needed) and yields its name."""
        directory = self.check(ref)
        name = ref.name
        async with self._changed:
            while name not in self._resident:
                if name in self._loading:
                    await self._changed.wait_for(lambda: name not in self._loading)
                    continue
                victim = await self._room()
                if victim is not None:
                    await self._evict(engine, victim)
                    continue  # the lock was let go meanwhile: look again
                await self._load(engine, directory, ref)
            self._resident[name] += 1
            self._resident.move_to_end(name)
        try:
            yield name
        finally:
            async with self._changed:
                self._resident[name] -= 1
                self._changed.notify_all()

    async def _room(self) -> str | None:
        """None once there is room for one more; else the adapter to evict (waiting for one not in use)."""
        while True:
            if len(self._resident) + len(self._loading) < self.config.max_resident:
                return None
            idle = next((n for n, users in self._resident.items() if users == 0), None)
            if idle is not None:
                return idle
            await self._changed.wait()

    async def _evict(self, engine: Engine, name: str) -> None:
        del self._resident[name]
        self._changed.release()
        try:
            await engine.remove_adapter(name)
        finally:
            await self._changed.acquire()
        self._evicted.add(name)
        metrics.ADAPTER_EVICTIONS.inc()
        log.info("adapter evicted", extra={"adapter": name[:16]})
        self._changed.notify_all()

    async def _load(self, engine: Engine, directory: Path, ref: AdapterRef) -> None:
        name = ref.name
        self._loading[name] = asyncio.get_running_loop().create_future()
        self._changed.release()  # other adapters' requests go on meanwhile
        try:
            adapter = await asyncio.to_thread(read_adapter, directory, ref.identity, self.config.max_rank)
            await engine.add_adapter(adapter)
        finally:
            await self._changed.acquire()
            self._loading.pop(name).set_result(None)
            self._changed.notify_all()
        self._resident[name] = 0
        kind = "reload" if name in self._evicted else "first"
        metrics.ADAPTER_LOADS.labels(kind).inc()
        log.info("adapter loaded", extra={"adapter": name[:16], "kind": kind, "rank": adapter.rank,
                                          "bytes": adapter.nbytes, "path": str(directory)})
