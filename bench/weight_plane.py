"""Weight plane throughput (MEMORY method) beside a raw TCP baseline, same run.

Run manual:
    python bench/weight_plane.py                    # 1 GiB bf16 state dict, 3 reps, ~3.9 MiB chunks
    python bench/weight_plane.py --size-mib 256 --reps 5 --chunk-mib 1
    python bench/weight_plane.py --smoke # seconds: checks it runs (CI)

A real synchronizer process (`python -m services.synchronizer`, keep_versions
1) and two worker processes, a "trainer" holding the state dict and a
"rollout" holding destination tensors of the same shapes, all on loopback:
  tcp           the trainer process sendall()s the state's bytes (1 MiB
                slices straight from tensor memory) to the rollout process,
                which recv_into()s a preallocated buffer: what the wire costs
                at best between these two processes.
  push          trainer -> synchronizer: `SynchronizerClient.push_weights` of
                a pre-encoded version (encoding, one checksum pass, is timed
                apart as `encode`), until the synchronizer verified and
                committed it. The trainer is on the synchronizer's host, so
                it writes the payloads to its shared-memory segment and
                streams the headers; the synchronizer copies each chunk out
                and verifies the copy (flywheel.synchronizer.push).
  push_stream   the same push with the payloads in the gRPC stream, as a
                trainer on another host sends them (`shared_memory=False`).
  pull          synchronizer -> rollout: `pull_weights(version, staging=...)`
                of that committed version, assembled and verified in the
                rollout's staging tensors (reused across pulls): the
                verified version the rollout hands its engine, as the push
                ends with the version verified in the synchronizer's buffer.
                The rollout is on the synchronizer's host, so it reads the
                payloads in place from the synchronizer's shared-memory
                segment (headers in the stream), as a co-located rollout does.
  pull_stream   the same pull with the payloads in the gRPC stream, as a
                rollout on another host gets them (`shared_memory=False`).
  cut_through   trainer -> synchronizer -> rollout: the rollout starts
                pulling version N+1 before it exists (wait_seconds), the
                trainer pushes it, and chunks are read on as they land; timed
                from the push's start to the rollout holding the verified version.
  cut_through_applied  the same, pulled `into=` live destination tensors
                (copied there after the digest check, as an engine's swap
                would): the transfer plus applying it.
  cut_through_stream  the same as cut_through, with the payloads in the pull's
                stream (a far rollout; the trainer still shares the
                synchronizer's host).
Each figure is the median of --reps rounds after a warm-up round (the cases
take turns within a round, so load changes hit all alike); every pulled
version is checked bit-exact (by hash) outside the timings. "cpu s" adds up
the user+system CPU seconds of every process on the path: on a host with
few free cores, cut-through (three busy processes) is bound by that sum.
Ends with one JSON line: `*_gbps` are 1e9 bytes/s; `push_vs_tcp` etc. are
throughput ratios; `cut_through_vs_push` is cut-through seconds / push
seconds (the goal: <= 1.3).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.codec import MAX_CHUNK_BYTES  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

MiB = 1 << 20


def make_state(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A bf16 state dict of about size_bytes: 32 MiB matrices and small vectors
    (norms), random bit patterns."""
    g = torch.Generator().manual_seed(seed)
    state, total, i = {}, 0, 0
    while total < size_bytes:
        for name, shape in ((f"layers.{i}.norm.weight", (4096,)), (f"layers.{i}.proj.weight", (4096, 4096))):
            state[name] = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
            total += 2 * torch.Size(shape).numel()
        i += 1
    return state


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process, or of `pid`."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def digest(tensors: dict[str, torch.Tensor]) -> int:
    h = xxhash.xxh3_64()
    for t in tensors.values():
        h.update(t.view(torch.uint8).numpy())
    return h.intdigest()


# -- worker processes ------------------------------------------------------------


def trainer_worker(address: str, size: int, chunk_bytes: int, conn) -> None:
    from flywheel.codec import encode_state_dict
    from flywheel.synchronizer.client import SynchronizerClient

    state = make_state(size)
    flat = memoryview(torch.cat([t.view(torch.uint8).flatten() for t in state.values()]).numpy())

    async def main() -> None:
        async with SynchronizerClient(address, transfer_timeout=600) as shared, \
                SynchronizerClient(address, transfer_timeout=600, shared_memory=False) as streamed:
            conn.send(("ready", digest(state)))
            while True:
                cmd, arg = await asyncio.to_thread(conn.recv)
                if cmd == "quit":
                    return
                if cmd == "tcp":
                    with socket.create_connection(("127.0.0.1", arg)) as s:
                        start, cpu = time.time(), cpu_seconds()
                        for i in range(0, len(flat), MiB):
                            s.sendall(flat[i : i + MiB])
                    conn.send((start, cpu_seconds() - cpu))
                elif cmd == "push":
                    version, in_place = arg
                    client = shared if in_place else streamed
                    t0 = time.perf_counter()
                    encoded = await asyncio.to_thread(encode_state_dict, state, version, chunk_bytes=chunk_bytes)
                    encode_seconds = time.perf_counter() - t0
                    conn.send(("encoded", encode_seconds))
                    await asyncio.to_thread(conn.recv)  # go
                    start, cpu = time.time(), cpu_seconds()
                    await client.push_weights(encoded)
                    conn.send((start, time.time(), cpu_seconds() - cpu))

    asyncio.run(main())


def rollout_worker(address: str, size: int, conn) -> None:
    from flywheel.synchronizer.client import SynchronizerClient

    dest = {k: torch.zeros_like(v) for k, v in make_state(size).items()}
    staging = {k: torch.ones_like(v) for k, v in dest.items()}  # touched: no page faults in the timings
    nbytes = sum(t.numel() * 2 for t in dest.values())
    buf = memoryview(bytearray(b"\1" * nbytes))

    async def main() -> None:
        async with SynchronizerClient(address, transfer_timeout=600) as shared, \
                SynchronizerClient(address, transfer_timeout=600, shared_memory=False) as streamed:
            conn.send(("ready", 0))
            while True:
                cmd, arg = await asyncio.to_thread(conn.recv)
                if cmd == "quit":
                    return
                if cmd == "tcp":
                    with socket.socket() as listener:
                        listener.bind(("127.0.0.1", 0))
                        listener.listen(1)
                        conn.send(listener.getsockname()[1])
                        sock, _ = listener.accept()
                        got, cpu = 0, cpu_seconds()
                        while got < nbytes:
                            got += sock.recv_into(buf[got:], min(nbytes - got, 4 * MiB))
                        conn.send((time.time(), cpu_seconds() - cpu))
                        sock.close()
                elif cmd == "pull":
                    version, wait, in_place, apply = arg
                    client = shared if in_place else streamed
                    start, cpu = time.time(), cpu_seconds()
                    pulled = await client.pull_weights(
                        version, into=dest if apply else None, staging=staging, wait_seconds=wait
                    )
                    end, cpu = time.time(), cpu_seconds() - cpu
                    conn.send((start, end, cpu, pulled.version, digest(pulled.tensors)))

    asyncio.run(main())


# -- orchestration ---------------------------------------------------------------


def _expect(conn, what: str):
    kind, value = conn.recv()
    assert kind == what, (kind, value)
    return value


def run(size: int, reps: int, chunk_bytes: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds and median CPU seconds (all processes involved) per path."""
    from flywheel.launcher.processes import start_service

    os.environ["FLYWHEEL_AUTH_TOKEN"] = secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_SYNCHRONIZER__")}
    run_dir = Path(tempfile.mkdtemp(prefix="flywheel-bench-"))
    sync = start_service("synchronizer", run_dir, ["--keep-versions", "1", "--server.log-level", "WARNING"], env)
    sync.wait_ready(120)
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    r_conn, r_child = ctx.Pipe()
    workers = [
        ctx.Process(target=trainer_worker, args=(sync.grpc_address, size, chunk_bytes, t_child), daemon=True),
        ctx.Process(target=rollout_worker, args=(sync.grpc_address, size, r_child), daemon=True),
    ]
    for w in workers:
        w.start()
    expected = _expect(t_conn, "ready")
    _expect(r_conn, "ready")
    keys = ("tcp", "push", "push_stream", "pull", "pull_stream", "cut_through", "cut_push", "cut_through_applied",
            "cut_through_stream", "encode")
    times: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    server_cpu = lambda: cpu_seconds(sync.process.pid)  # noqa: E731

    def push(version: int, in_place: bool = True) -> None:
        t_conn.send(("push", (version, in_place)))
        times["encode"].append(_expect(t_conn, "encoded"))
        t_conn.send(("go", None))

    try:
        version = 0
        for _ in range(reps + 1):  # the first round warms up every path
            r_conn.send(("tcp", None))
            t_conn.send(("tcp", r_conn.recv()))
            (start, c1), (end, c2) = t_conn.recv(), r_conn.recv()
            times["tcp"].append(end - start)
            cpu["tcp"].append(c1 + c2)

            for in_place, key in ((False, "push_stream"), (True, "push")):  # the last one stays to be pulled
                version += 1
                s0 = server_cpu()
                push(version, in_place)
                start, end, c1 = t_conn.recv()
                times[key].append(end - start)
                cpu[key].append(c1 + server_cpu() - s0)

            for in_place, key in ((True, "pull"), (False, "pull_stream")):
                s0 = server_cpu()
                r_conn.send(("pull", (version, 0.0, in_place, False)))
                start, end, c2, got, hashed = r_conn.recv()
                assert got == version and hashed == expected, "pull is not bit-exact"
                times[key].append(end - start)
                cpu[key].append(c2 + server_cpu() - s0)

            cut_cases = ((True, False, "cut_through"), (True, True, "cut_through_applied"),
                         (False, False, "cut_through_stream"))
            for in_place, apply, key in cut_cases:
                version += 1
                r_conn.send(("pull", (version, 60.0, in_place, apply)))
                time.sleep(0.5)  # the pull is waiting for the version before the push starts
                s0 = server_cpu()
                push(version)
                push_start, push_end, c1 = t_conn.recv()
                _, end, c2, got, hashed = r_conn.recv()
                assert got == version and hashed == expected, "cut-through pull is not bit-exact"
                times[key].append(end - push_start)
                cpu[key].append(c1 + c2 + server_cpu() - s0)
                if key == "cut_through":
                    times["cut_push"].append(push_end - push_start)
            cpu["cut_push"].append(0.0)
            cpu["encode"].append(0.0)
    finally:
        for conn in (t_conn, r_conn):
            conn.send(("quit", None))
        for w in workers:
            w.join(timeout=30)
        sync.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    median = lambda v: statistics.median(v[1:] if len(v) > 1 else v)  # noqa: E731
    return {k: median(v) for k, v in times.items()}, {k: median(v) for k, v in cpu.items()}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--size-mib", type=int, default=1024, help="state dict size, MiB, a multiple of 32 (default 1024; smoke 32)")
    parser.add_argument("--reps", type=int, default=3,
                        help="timed rounds (median), after one warm-up round (default 3; smoke 1)")
    parser.add_argument(
        "--chunk-mib", type=float, default=MAX_CHUNK_BYTES / MiB, help="payload per chunk, MiB (default: push_weights')"
    )
    args = parse_with_smoke(parser, "32 MiB, one round: checks the bench runs (CI)", size_mib=32, reps=1)
    if args.size_mib <= 0 or args.size_mib % 32:
        parser.error(f"--size-mib {args.size_mib}: the state is built of 32 MiB matrices; give a multiple of 32")
    size = args.size_mib * MiB
    nbytes = sum(t.numel() * 2 for t in make_state(size).values())
    seconds, cpu = run(size, args.reps, int(args.chunk_mib * MiB))
    gbps = {k: nbytes / v / 1e9 for k, v in seconds.items()}
    load = os.getloadavg()[0]
    print(f"weight plane, {nbytes / 2**30:.2f} GiB bf16, chunks {args.chunk_mib:g} MiB, median of {args.reps}; "
          f"{os.cpu_count()} cores, load average {load:.1f} (GB/s = 1e9 B/s)")
    print(f"{'path':<38}{'seconds':>9}{'GB/s':>8}{'vs tcp':>8}{'cpu s':>8}")
    labels = {
        "tcp": "raw TCP trainer->rollout", "encode": "encode (checksum pass, apart)",
        "push": "push trainer->synchronizer", "push_stream": "  payloads in the stream",
        "pull": "pull synchronizer->rollout", "pull_stream": "  payloads in the stream",
        "cut_through": "cut-through trainer->sync->rollout", "cut_push": "  its push, meanwhile",
        "cut_through_applied": "  applied into live tensors",
        "cut_through_stream": "  payloads in the stream",
    }
    for key, label in labels.items():
        used = f"{cpu[key]:>8.2f}" if cpu[key] else f"{'':>8}"
        print(f"{label:<38}{seconds[key]:>9.3f}{gbps[key]:>8.2f}{gbps[key] / gbps['tcp']:>7.2f}x{used}")
    figures = {
        "bench": "weight_plane", "bytes": nbytes, "chunk_bytes": int(args.chunk_mib * MiB), "reps": args.reps,
        "cores": os.cpu_count(), "load_average": round(load, 2),
        **{f"{k}_gbps": round(v, 3) for k, v in gbps.items() if k != "cut_push"},
        **{f"{k}_cpu_seconds": round(v, 3) for k, v in cpu.items() if v},
        "push_vs_tcp": round(gbps["push"] / gbps["tcp"], 3),
        "push_stream_vs_tcp": round(gbps["push_stream"] / gbps["tcp"], 3),
        "shared_push_vs_stream_push": round(gbps["push"] / gbps["push_stream"], 3),
        "pull_vs_tcp": round(gbps["pull"] / gbps["tcp"], 3),
        "cut_through_vs_tcp": round(gbps["cut_through"] / gbps["tcp"], 3),
        "cut_through_vs_push": round(seconds["cut_through"] / seconds["push"], 3),
        "cut_through_applied_vs_push": round(seconds["cut_through_applied"] / seconds["push"], 3),
        "pull_stream_vs_tcp": round(gbps["pull_stream"] / gbps["tcp"], 3),
        "cut_through_stream_vs_push": round(seconds["cut_through_stream"] / seconds["push"], 3),
        # How long the rollout still needed once the push had ended (the cost
        # of the extra hop), and how much the concurrent pull slowed the push
        # itself (CPU contention: three busy processes on few cores).
        "cut_through_after_push_seconds": round(seconds["cut_through"] - seconds["cut_push"], 3),
        "cut_through_vs_its_push": round(seconds["cut_through"] / seconds["cut_push"], 3),
        "cut_push_vs_push": round(seconds["cut_push"] / seconds["push"], 3),
    }
    print(f"end to end on one host {figures['cut_through_vs_tcp']:.2f}x raw TCP (goal >= 0.6); "
          f"cut-through takes {figures['cut_through_vs_push']:.2f}x the single push, "
          f"{figures['cut_through_applied_vs_push']:.2f}x applied into live tensors, "
          f"{figures['cut_through_stream_vs_push']:.2f}x with the payloads in the stream; "
          f"cpu s = user+system seconds of every process on the path")
    record("weight_plane", figures, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
