"""Checkpoints: atomic `global_step_N/` directories, exact resume, keep-last-K.

Layout of one checkpoint:

    global_step_N/
      model/               HF directory (config, safetensors, tokenizer):
                           AutoModelForCausalLM.from_pretrained loads it; with
                           LoRA the adapters are merged into these weights
      adapter/             LoRA only: the peft adapter (what resume loads)
      optimizer.pt         AdamW state dict
      scheduler.pt         LR scheduler state dict
      rng.pt, rng.json     torch (+CUDA) RNG tensors; python and numpy RNG states
      client_state.bin     opaque bytes of the caller (e.g. a data cursor)
      trainer_state.json   step, weight version, model, lora; written last

A sharded policy (`parallel`, FSDP2 ranks) writes the same directory with
`sharded/` (torch.distributed.checkpoint: every rank's shards of the model
and the optimizer, each rank writing its own) in place of optimizer.pt,
`rank_<r>/rng.pt` + `rng.json` per rank, and `world_size` in
trainer_state.json; `model/` holds the whole weights, gathered one
parameter at a time on rank 0. DCP reshards on load, so any number of ranks
resumes it exactly (the same number of ranks gives bit-identical next steps).

Everything is written into a hidden `.tmp-…` sibling, fsynced, then renamed to
`global_step_N`, so a crash never leaves a directory with the final name that
is incomplete; `list_checkpoints` also requires trainer_state.json.
Loading reads and checks every file before touching the live policy, so a bad
checkpoint leaves the model and optimizer as they were.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from flywheel.codec.checkpoint_dir import read_tensors, safetensors_files
from flywheel.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from flywheel.trainer.types import LoraShape
from services.trainer.distributed import Ranks, gather_state
from services.trainer.files import replace_directory
from services.trainer.hf_save import save_hf
from services.trainer.policy import Policy, restore_optimizer_kernels, rng_state, set_rng_state

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
_NAME = re.compile(r"^global_step_(\d+)$")


def list_checkpoints(parent: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `parent`, oldest step first."""
    if not parent.is_dir():
        return []
    found = []
    for child in parent.iterdir():
        match = _NAME.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest(parent: Path) -> Path | None:
    found = list_checkpoints(parent)
    return found[-1][1] if found else None


def _tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _write(policy: Policy, out: Path, client_state: bytes) -> None:
    model_dir = out / "model"
    if policy.lora:
        policy.hf_model.save_pretrained(model_dir, state_dict=policy.hf_state_dict())
        policy.model.save_pretrained(out / "adapter")
    else:
        policy.model.save_pretrained(model_dir)
    if policy.tokenizer is not None:
        policy.tokenizer.save_pretrained(model_dir)
    torch.save(policy.optimizer.state_dict(), out / "optimizer.pt")
    torch.save(policy.scheduler.state_dict(), out / "scheduler.pt")
    _write_rng(out)
    (out / "client_state.bin").write_bytes(client_state)
    state = {"format_version": FORMAT_VERSION, "step": policy.step, "weight_version": policy.weight_version,
             "model": policy.name, "lora": policy.lora}
    if policy.lora:  # the model's own rank and modules (its adapters past them are zero)
        state["lora_shape"] = {"rank": policy.shape.rank, "modules": list(policy.shape.modules)}
    (out / STATE_FILE).write_text(json.dumps(state))


def _write_rng(out: Path) -> None:
    rng = rng_state()
    torch.save({"torch": rng["torch"], "cuda": rng.get("cuda", [])}, out / "rng.pt")
    py_version, py_state, py_gauss = rng["python"]
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    (out / "rng.json").write_text(json.dumps({
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }))


def _read_rng(directory: Path) -> dict:
    """The RNG states `_write_rng` wrote, as `set_rng_state` takes them."""
    import numpy as np

    rng_json = json.loads((directory / "rng.json").read_text())
    rng_tensors = torch.load(directory / "rng.pt", map_location="cpu", weights_only=True)
    py, npy = rng_json["python"], rng_json["numpy"]
    return {
        "python": (py[0], tuple(py[1]), py[2]),
        "numpy": (npy[0], np.asarray(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4]),
        "torch": rng_tensors["torch"],
        **({"cuda": rng_tensors["cuda"]} if rng_tensors.get("cuda") else {}),
    }


def _fresh_tmp(parent: Path, step: int) -> Path:
    """A new temporary directory under `parent` for step `step`'s checkpoint, once the ones
    a crash mid-save left there are removed."""
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(".tmp-global_step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-global_step_{step}-", dir=parent))


def _publish(
    tmp: Path, final: Path, step: int, write: Callable[[], object], keep_last: int, remove_previous: bool, **extra
) -> int:
    """Runs `write` (the last files into `tmp`), renames `tmp` to `final` atomically (removing
    `tmp` if either fails) and prunes older checkpoints; returns the size of `final` in bytes."""
    try:
        write()
        replace_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(final.parent, final, step, keep_last, remove_previous)
    size = _tree_size(final)
    log.info("checkpoint saved", extra={"path": str(final), "step": step, "bytes": size, **extra})
    return size


def save(
    policy: Policy, parent: Path, *, client_state: bytes = b"", keep_last: int = 0, remove_previous: bool = False
) -> tuple[Path, int]:
    """Writes global_step_<step> under `parent` atomically; returns (path, size in bytes)."""
    final = parent / f"global_step_{policy.step}"
    tmp = _fresh_tmp(parent, policy.step)
    return final, _publish(tmp, final, policy.step, lambda: _write(policy, tmp, client_state), keep_last, remove_previous)


def _prune(parent: Path, keep: Path, step: int, keep_last: int, remove_previous: bool) -> None:
    others = [(s, p) for s, p in list_checkpoints(parent) if p != keep]
    doomed = [p for s, p in others if s < step] if remove_previous else []
    if keep_last > 0:
        doomed += [p for _s, p in others[: max(0, len(others) - (keep_last - 1))]]
    for path in dict.fromkeys(doomed):
        shutil.rmtree(path, ignore_errors=True)
        log.info("checkpoint removed", extra={"path": str(path)})


def _read_weights(directory: Path) -> dict[str, Tensor]:
    """The tensors of a checkpoint's model/ or adapter/ directory; a missing one is DATA_LOSS
    (the checkpoint says it is complete)."""
    try:
        files = safetensors_files(directory)
    except NotFound as exc:
        raise DataLoss(f"checkpoint: {exc}") from None
    return read_tensors(files)


def _check_model_weights(policy: Policy, weights: dict[str, Tensor]) -> None:
    live = policy.model.state_dict()
    # Tied weights (e.g. lm_head = embed_tokens) are saved once.
    by_storage: dict[int, list[str]] = {}
    for name, t in live.items():
        by_storage.setdefault(t.data_ptr(), []).append(name)
    missing = [n for n in live if n not in weights and not any(o in weights for o in by_storage[live[n].data_ptr()])]
    unexpected = [n for n in weights if n not in live]
    if missing or unexpected:
        raise InvalidArgument(
            f"checkpoint: weights do not match the loaded model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    for name, t in weights.items():
        if t.shape != live[name].shape or t.dtype != live[name].dtype:
            raise InvalidArgument(
                f"checkpoint: {name} is {t.dtype} {list(t.shape)}, the model has {live[name].dtype} {list(live[name].shape)}"
            )


def _check_optimizer(policy: Policy, saved: dict) -> None:
    live = [len(g["params"]) for g in policy.optimizer.param_groups]
    got = [len(g["params"]) for g in saved.get("param_groups", [])]
    if live != got:
        raise InvalidArgument(f"checkpoint: optimizer has parameter groups of sizes {got}, the model needs {live}")


def load(policy: Policy, path: Path) -> tuple[int, int, bytes]:
    """Restores model, optimizer, scheduler, RNG and step; returns (step, weight_version, client_state)."""
    if not path.is_dir():
        raise NotFound(f"checkpoint {path}: no such directory")
    if not (path / STATE_FILE).is_file():
        raise InvalidArgument(f"checkpoint {path}: not a complete checkpoint (no {STATE_FILE})")
    with contextlib.suppress(OSError, ValueError):
        sharded = json.loads((path / STATE_FILE).read_text()).get("world_size")
        if sharded:
            raise FailedPrecondition(
                f"checkpoint {path}: written by {sharded} sharded ranks; resume it with parallel on "
                "(its model/ directory loads anywhere as weights)"
            )
    try:
        state = json.loads((path / STATE_FILE).read_text())
        optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        scheduler = torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True)
        rng = _read_rng(path)
        client_state = (path / "client_state.bin").read_bytes()
    except (OSError, ValueError, RuntimeError) as exc:
        raise DataLoss(f"checkpoint {path}: unreadable: {exc}") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise InvalidArgument(f"checkpoint {path}: format_version {state.get('format_version')} is not {FORMAT_VERSION}")
    if bool(state.get("lora")) != policy.lora:
        raise FailedPrecondition(
            f"checkpoint {path}: saved with lora={state.get('lora')} but the trainer runs with lora={policy.lora}"
        )
    _check_optimizer(policy, optimizer)
    if policy.lora:
        saved_shape = state.get("lora_shape") or {}
        shape = policy.resolve_shape(LoraShape(int(saved_shape.get("rank", 0)), tuple(saved_shape.get("modules", ()))))
        weights = _read_weights(path / "adapter")
    else:
        weights = _read_weights(path / "model")
        _check_model_weights(policy, weights)

    # Everything is read and checked: apply.
    if policy.lora:
        _load_adapter(policy, weights, path)
        policy.set_shape(shape)  # its zeros are zero already: this scales the model as its rank
    else:
        with torch.no_grad():
            policy.model.load_state_dict(weights, strict=False)
    policy.optimizer.load_state_dict(optimizer)
    restore_optimizer_kernels(policy.optimizer)
    policy.scheduler.load_state_dict(scheduler)
    set_rng_state(rng)
    policy.zero_grad()
    policy.step = int(state["step"])
    policy.weight_version = int(state["weight_version"])
    log.info("checkpoint loaded", extra={"path": str(path), "step": policy.step})
    return policy.step, policy.weight_version, client_state


def _load_adapter(policy: Policy, weights: dict[str, Tensor], path: Path) -> None:
    from peft import set_peft_model_state_dict

    trainable = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    backup = {n: p.detach().clone() for n, p in trainable.items()}  # adapters are small
    result = set_peft_model_state_dict(policy.model, weights)
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(backup[n])
        raise InvalidArgument(f"checkpoint {path}: adapter weights do not match the model ({unexpected[:5]})")


# ---------------------------------------------------------------- sharded (FSDP2 ranks)


def save_sharded(
    policy: Policy, parent: Path, ranks: Ranks, *, client_state: bytes = b"", keep_last: int = 0,
    remove_previous: bool = False,
) -> tuple[Path, int]:
    """Every rank calls it together; writes global_step_<step> atomically; returns (path, size) on every rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from flywheel.codec import DEFAULT_BUCKET_BYTES

    first = ranks.rank == 0
    final = parent / f"global_step_{policy.step}"
    box: list = [None]
    if first:
        box[0] = str(_fresh_tmp(parent, policy.step))
    dist.broadcast_object_list(box, src=0, group=ranks.control)
    tmp = Path(box[0])
    error: BaseException | None = None
    try:
        model_state, optim_state = get_state_dict(policy.model, policy.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "sharded"))
        (tmp / f"rank_{ranks.rank}").mkdir()
        _write_rng(tmp / f"rank_{ranks.rank}")
        weights = gather_state(policy.model, DEFAULT_BUCKET_BYTES, keep=first)
        if first:
            (tmp / "model").mkdir()
            save_hf(policy.hf_model, tmp / "model", weights)
            del weights
            if policy.tokenizer is not None:
                policy.tokenizer.save_pretrained(tmp / "model")
            torch.save(policy.scheduler.state_dict(), tmp / "scheduler.pt")
            (tmp / "client_state.bin").write_bytes(client_state)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone renames
        error = exc
    if not ranks.all_agree(error is None):
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise FailedPrecondition(f"checkpoint {final}: another rank failed to write its shards; nothing saved")
    size = 0
    if first:
        state = {"format_version": FORMAT_VERSION, "step": policy.step, "weight_version": policy.weight_version,
                 "model": policy.name, "lora": policy.lora, "world_size": ranks.world_size}
        size = _publish(tmp, final, policy.step, lambda: (tmp / STATE_FILE).write_text(json.dumps(state)),
                        keep_last, remove_previous, world_size=ranks.world_size)
    return final, size


def load_sharded(policy: Policy, path: Path, ranks: Ranks) -> tuple[int, int, bytes]:
    """Every rank calls it together: restores shards, optimizer, scheduler, this rank's RNG and the step.
    Everything is read and checked on every rank before any of them applies it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    error: BaseException | None = None
    try:
        if not path.is_dir():
            raise NotFound(f"checkpoint {path}: no such directory")
        if not (path / STATE_FILE).is_file():
            raise InvalidArgument(f"checkpoint {path}: not a complete checkpoint (no {STATE_FILE})")
        try:
            state = json.loads((path / STATE_FILE).read_text())
            scheduler = torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True)
            client_state = (path / "client_state.bin").read_bytes()
            own = path / f"rank_{ranks.rank}"
            # More ranks than wrote it: the new ones keep their RNG as seeded.
            rng = _read_rng(own) if own.is_dir() else None
        except (OSError, ValueError, RuntimeError) as exc:
            raise DataLoss(f"checkpoint {path}: unreadable: {exc}") from None
        if not state.get("world_size"):
            raise FailedPrecondition(f"checkpoint {path}: written by one unsharded trainer; a sharded trainer "
                                     "resumes only sharded checkpoints")
        if state.get("format_version") != FORMAT_VERSION:
            raise InvalidArgument(f"checkpoint {path}: format_version {state.get('format_version')} is not {FORMAT_VERSION}")
        # get_state_dict gives the optimizer state its shape (AdamW has none before its first step).
        model_state, optim_state = get_state_dict(policy.model, policy.optimizer)
        try:
            dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path / "sharded"))
        except Exception as exc:  # noqa: BLE001 - DCP raises CheckpointException, RuntimeError, KeyError...
            raise DataLoss(f"checkpoint {path}: sharded state does not load: {exc}") from None
    except Exception as exc:  # noqa: BLE001
        error = exc
    if not ranks.all_agree(error is None):
        policy.zero_grad()
        if error is not None:
            raise error
        raise FailedPrecondition(f"checkpoint {path}: another rank could not read it; nothing loaded")
    set_state_dict(policy.model, policy.optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    restore_optimizer_kernels(policy.optimizer)
    policy.scheduler.load_state_dict(scheduler)
    if rng is not None:
        set_rng_state(rng)
    policy.zero_grad()
    policy.step = int(state["step"])
    policy.weight_version = int(state["weight_version"])
    log.info("checkpoint loaded", extra={"path": str(path), "step": policy.step, "world_size": ranks.world_size})
    return policy.step, policy.weight_version, client_state
