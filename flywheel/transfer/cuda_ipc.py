"""CUDA memory handed between processes on one GPU, described as plain data.

A transfer group with backend "ipc" (`flywheel.transfer.broadcast`) moves a
version from a trainer to replicas that share its GPU (co-located): rank 0
packs each bucket into one device buffer, and every receiver maps that
buffer (a CUDA IPC handle, opened once per transfer) and copies the bucket
into its own staging memory, device to device; nothing crosses the host.

torch's own reduction (`torch.multiprocessing.reductions.reduce_tensor`)
makes the handle; it is written here as JSON (bytes in base64, the tensor
and storage classes implied) rather than pickled, because it travels
through the rendezvous store, which any peer can write: a pickle from it
would run whatever the peer put there.

Components advertise the GPU they compute on by its physical UUID (label
`gpu`, `gpu_label`): the synchronizer's `auto` backend picks ipc only when
every member of a transfer names the same one.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from flywheel.errors import FailedPrecondition, InvalidArgument

#: The component label naming the physical GPU a component computes on.
GPU_LABEL = "gpu"


def gpu_uuid(device: torch.device | str) -> str:
    """The physical UUID of a CUDA device ("" for any other device, or without CUDA)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def gpu_label(device: torch.device | str) -> dict[str, str]:
    """{GPU_LABEL: uuid} for a CUDA device, else nothing."""
    uuid = gpu_uuid(device)
    return {GPU_LABEL: uuid} if uuid else {}


def require_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise FailedPrecondition(
            f"{what}: backend ipc hands over CUDA memory, but this side is on {device.type}; "
            "use nccl or gloo for members that do not share one GPU"
        )


def share(buffer: torch.Tensor) -> dict[str, Any]:
    """A description of `buffer` (a CUDA tensor) another process on the same GPU can `open`."""
    from torch.multiprocessing.reductions import reduce_tensor

    require_cuda(buffer.device, "sharing a buffer")
    _, args = reduce_tensor(buffer)
    (_, size, stride, offset, _, dtype, _, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    return {
        "gpu": gpu_uuid(buffer.device), "size": list(size), "stride": list(stride), "offset": int(offset),
        "dtype": str(dtype).removeprefix("torch."), "handle": _b64(handle), "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset), "ref_handle": _b64(ref_handle), "ref_offset": int(ref_offset),
        "event_handle": _b64(event_handle), "event_sync": bool(event_sync),
    }


def open_shared(shared: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The tensor `share` described, mapped on `device` (which must be the same physical GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    require_cuda(device, "opening a shared buffer")
    here = gpu_uuid(device)
    if shared.get("gpu") != here:
        raise FailedPrecondition(
            f"backend ipc: the sender's buffer is on GPU {shared.get('gpu')!r}, this side on {here!r}; "
            "ipc needs every member on one GPU"
        )
    try:
        dtype = getattr(torch, str(shared["dtype"]))
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"not a dtype: {shared['dtype']!r}")
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(shared["size"]), tuple(shared["stride"]), int(shared["offset"]),
            torch.storage.TypedStorage, dtype, device.index if device.index is not None else torch.cuda.current_device(),
            _bytes(shared["handle"]), int(shared["storage_bytes"]), int(shared["storage_offset"]), False,
            _bytes(shared["ref_handle"]), int(shared["ref_offset"]), _bytes(shared["event_handle"]),
            bool(shared["event_sync"]),
        )
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # AttributeError: no such torch dtype
        raise InvalidArgument(f"backend ipc: the shared buffer's description is malformed: {exc}") from None


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
