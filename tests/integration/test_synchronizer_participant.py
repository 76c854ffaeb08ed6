"""Test participants of NCCL/gloo transfers, run as separate processes by
test_synchronizer_groups.py (this module holds no tests):

    python -m tests.integration.test_synchronizer_participant trainer ADDRESS --versions 3
    python -m tests.integration.test_synchronizer_participant rollout ADDRESS --id rollout-a --versions 3 \
        [--fail-version 2 --fail-bucket 1]

Both use only the product path: `SynchronizerClient` and
`flywheel.synchronizer.participant` over `flywheel.transfer.broadcast`. Each
prints one JSON line per transfer (outcome, and for rollouts the digest of
their live weights afterwards), after a first "ready" line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch
import xxhash

BUCKET_BYTES = 64 * 1024


def weights(version: int) -> dict[str, torch.Tensor]:
    """Version `version` of a small model (version 0: the rollouts' initial zeros)."""
    g = torch.Generator().manual_seed(version)
    shapes = {"embed.weight": (256, 96), "layers.0.attn.weight": (96, 96), "layers.0.norm": (96,), "lm_head.weight": (256, 96)}
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if version == 0:
            out[name] = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            out[name] = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
    out["step"] = torch.tensor(version, dtype=torch.int64)
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def emit(**record) -> None:
    print(json.dumps({**record, "t": round(time.time(), 3)}), flush=True)


async def trainer(args: argparse.Namespace) -> None:
    from flywheel.synchronizer.client import SynchronizerClient
    from flywheel.synchronizer.participant import broadcast_version

    async with SynchronizerClient(args.address) as client:
        await client.register("trainer", args.id, address="127.0.0.1:1", capabilities=["nccl"])
        emit(ready=args.id)
        await asyncio.to_thread(sys.stdin.readline)  # "go": the rollouts are listening
        async with client.keep_alive(args.id):
            for version in range(1, args.versions + 1):
                outcome = await broadcast_version(
                    client, args.id, version, weights(version), rollout_ids=tuple(args.rollouts),
                    timeout_seconds=30, backend="gloo", bucket_bytes=BUCKET_BYTES,
                )
                emit(id=args.id, version=version, state=outcome.state.name, error=outcome.error)
        await client.deregister(args.id)  # a clean exit: leave at once, not at lease expiry


async def rollout(args: argparse.Namespace) -> None:
    from flywheel.synchronizer.client import SynchronizerClient
    from flywheel.synchronizer.participant import receive_version
    from flywheel.synchronizer.types import EventKind

    live = weights(0)
    async with SynchronizerClient(args.address) as client:
        await client.register("rollout", args.id, capabilities=["nccl"])
        async with client.keep_alive(args.id, lambda: (0, int(live["step"]))):
            events = client.watch([args.id], send_initial=True)
            await anext(events)  # the initial snapshot: the subscription is live
            emit(ready=args.id)
            done = 0
            async for event in events:
                if event.kind != EventKind.TRANSFER_STARTED or event.group is None:
                    continue
                version = event.group.version

                def fail(bucket: int, version: int = version) -> None:
                    if version == args.fail_version and bucket == args.fail_bucket:
                        raise RuntimeError(f"injected failure at bucket {bucket}")

                outcome, staged = await receive_version(client, args.id, event.group, live, on_bucket=fail)
                emit(id=args.id, version=version, state=outcome.state.name, error=outcome.error,
                     applied=staged is not None, live=digest(live))
                done += 1
                if done == args.versions:
                    break
        await client.deregister(args.id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["trainer", "rollout"])
    parser.add_argument("address")
    parser.add_argument("--id", default="trainer")
    parser.add_argument("--versions", type=int, default=1)
    parser.add_argument("--rollouts", nargs="*", default=[])
    parser.add_argument("--fail-version", type=int, default=0)
    parser.add_argument("--fail-bucket", type=int, default=-1)
    args = parser.parse_args()
    asyncio.run(trainer(args) if args.role == "trainer" else rollout(args))


if __name__ == "__main__":
    sys.exit(main())
