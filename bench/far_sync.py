"""A new version reaching a far replica: as a delta, resumed after a cut, beside raw TCP, one run.

Run manual (as root: network namespaces; ~4 minutes on 2 cores):
    python bench/far_sync.py                          # the quickstart's first 2 versions (SmolLM2-135M), bfloat16
    python bench/far_sync.py --run-dir runs/quickstart --from-step 10 --to-step 20
    python bench/far_sync.py --smoke                  # the tiny quickstart (CI)

The link is emulated (flywheel/testing/link_emulator.py): 100 Mbit/s, 20 ms each way (40 ms
round trip), 0.1 % of packets lost, real kernel TCP at both ends. The synchronizer runs at the
`near` end with versions M and N committed (pushed from its side of the link, as a trainer next
to it would); the far replica runs at the other end and holds version M. Measured in the same run:

  full_tcp      the baseline: the full version's bytes sent over the link by raw TCP (sendall into
                a socket, recv_into at the far end), what any transfer of the whole model costs;
  full_pull     the far replica pulls N in full (`pull_weights`): the chunks, checked and verified;
  compressed_pull  the same with each chunk zstd-compressed (flywheel/transfer/compression.py);
                beside it, the compressor's speeds on N's bytes here and the link rate below which
                compressing pays (`compression_pays_below_mb_s`);
  delta_pull    the far replica pulls N as a delta from M (`pull_weights(base=M)`), time until it
                holds N verified bit for bit against N's identity; the first replica to ask pays
                for the delta's encoding on the synchronizer (`delta_pull_cold`), the next one not
                (`delta_pull`, the figure);
  resume        a full pull whose connection is reset when half the version has arrived (a TCP
                forwarder at the near end, flywheel/testing/cut_proxy.py, resets it); the pull
                resumes from the first chunk it lacks: bytes through the forwarder over one full copy.
  relay         four far replicas behind one relay at their site (a synchronizer in relay mode,
                services/synchronizer/relay.py, holding nothing yet), started together: time until
                the last holds N verified, over one replica's alone pulling N across the link
                (`relay_last_vs_one`, goal <= 1.3);
  same_host     bench/weight_plane.py's trainer -> synchronizer -> rollout on one host (cut-through,
                payloads in place) over raw loopback TCP, run as a subprocess in the same run.

Ratios: `delta_vs_full_tcp` (full_tcp seconds / delta_pull seconds, goal >= 5),
`resume_bytes_vs_one_copy` (goal <= 1.1), `relay_last_vs_one` (goal <= 1.3), `same_host_vs_tcp`
(goal >= 0.6), `full_pull_vs_full_tcp`, `compressed_pull_vs_full_pull`.
Every pulled version is checked bit-exact outside the timings. Ends with one JSON line, the CPU named.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.testing.machine import cpu  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

SYNC_PORT, PROXY_PORT, TCP_PORT, RELAY_PORT = 50151, 50152, 50153, 50154
#: Far replicas behind the relay.
REPLICAS = 4
RATE_BITS, DELAY, LOSS = 100e6, 0.020, 0.001


# -- helpers run inside the namespaces (this script, called with a leading _command) -----------------

def _load(path: str):
    from safetensors.torch import load_file

    return load_file(path)


def _cmd_push(args: list[str]) -> None:
    from flywheel.synchronizer.client import SynchronizerClient

    address, files = args[0], args[1:]

    async def push() -> None:
        async with SynchronizerClient(address, shared_memory=False) as client:
            for version, path in enumerate(files, start=1):
                await client.push_weights(_load(path), version)

    asyncio.run(push())
    print("pushed", flush=True)


def _cmd_pull(args: list[str]) -> None:
    """[--compress] address version expect_file [base_version base_file]: prints the pull's figures as JSON."""
    import torch

    from flywheel.codec.identity import identify
    from flywheel.synchronizer.client import SynchronizerClient
    from flywheel.synchronizer.client_types import DeltaBase

    compress = args[0] == "--compress"
    args = args[1:] if compress else args
    address, version, expect = args[0], int(args[1]), _load(args[2])
    base = None
    if len(args) > 3:
        tensors = _load(args[4])
        base = DeltaBase(int(args[3]), identify(tensors), tensors)

    async def pull():
        async with SynchronizerClient(address, shared_memory=False, transfer_timeout=600, compress=compress) as client:
            started = time.perf_counter()
            pulled = await client.pull_weights(version, base=base)
            return time.perf_counter() - started, time.time(), pulled

    # Imports and files are loaded: start when told, so that several replicas start together.
    print("ready", flush=True)
    sys.stdin.readline()
    seconds, ended, pulled = asyncio.run(pull())
    exact = pulled.tensors.keys() == expect.keys() and all(
        torch.equal(pulled.tensors[k].view(torch.uint8), expect[k].view(torch.uint8)) for k in expect)
    print(json.dumps({"seconds": seconds, "ended": ended, "stream_bytes": pulled.stats.stream_bytes,
                      "resumes": pulled.stats.resumes, "delta_base": pulled.stats.delta_base, "exact": exact}),
          flush=True)


def _cmd_proxy(args: list[str]) -> None:
    """listen_host: a CutProxy in front of the synchronizer; stdin: "cut N" arms a cut, "bytes" prints the count."""
    from flywheel.testing.cut_proxy import CutProxy

    async def serve() -> None:
        async with CutProxy("127.0.0.1", SYNC_PORT, listen_host=args[0], listen_port=PROXY_PORT) as proxy:
            print("listening", flush=True)
            loop = asyncio.get_running_loop()
            while line := (await loop.run_in_executor(None, sys.stdin.readline)).split():
                if line[0] == "cut":
                    proxy.cut_after(int(line[1]))
                    print("armed", flush=True)
                elif line[0] == "bytes":
                    print(json.dumps({"downstream": proxy.downstream_bytes, "cuts": proxy.cuts}), flush=True)

    asyncio.run(serve())


def _cmd_tcp_recv(args: list[str]) -> None:
    host, n = args[0], int(args[1])
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, TCP_PORT))
    server.listen(1)
    print("listening", flush=True)
    conn, _ = server.accept()
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        read = conn.recv_into(view[got:], min(n - got, 1 << 20))
        if not read:
            break
        got += read
    conn.sendall(f"{got}\n".encode())


def _cmd_tcp_send(args: list[str]) -> None:
    host, n = args[0], int(args[1])
    block = os.urandom(1 << 20)
    started = time.perf_counter()
    conn = socket.create_connection((host, TCP_PORT), timeout=600)
    sent = 0
    while sent < n:
        part = memoryview(block)[: min(len(block), n - sent)]
        conn.sendall(part)
        sent += len(part)
    got = int(conn.makefile().readline())
    print(json.dumps({"seconds": time.perf_counter() - started, "received": got}), flush=True)


COMMANDS = {"_push": _cmd_push, "_pull": _cmd_pull, "_proxy": _cmd_proxy, "_tcp_recv": _cmd_tcp_recv,
            "_tcp_send": _cmd_tcp_send}


# -- the bench ------------------------------------------------------------------------------------

def _versions(args, work: Path) -> tuple[Path, Path, dict]:
    """Versions M and N as bfloat16 safetensors files, and what they are."""
    import torch
    from safetensors.torch import save_file

    from flywheel.testing.run_versions import load, make_run, versions

    run_dir = args.run_dir or make_run(args.smoke, 2, work)
    chain = dict(versions(run_dir))
    m, n = args.from_step, args.to_step
    if m not in chain or n not in chain:
        raise SystemExit(f"{run_dir}: no checkpoints of steps {m} and {n} (has {sorted(chain)})")
    files = []
    for step in (m, n):
        state = load(chain[step], torch.bfloat16)  # what a GPU deployment publishes
        path = work / f"v{step}.safetensors"
        save_file(state, str(path))
        files.append(path)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return files[0], files[1], {"run_dir": str(run_dir), "from_step": m, "to_step": n, "full_bytes": nbytes}


def _json_line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a bench helper exited without an answer ({proc.poll()})")
    return json.loads(line)


def _run(link, side: str, *argv: str, timeout: float = 900) -> dict:
    return _together(link, side, [list(argv)], timeout)[0]


def _together(link, side: str, argvs: list[list[str]], timeout: float = 900) -> list[dict]:
    """Helpers started at once once each is ready (a pull: loaded and waiting); their answers, and
    each answer's `ended` made relative to the common start (`since_start`)."""
    procs = [link.popen(side, [sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        text=True, cwd=ROOT) for argv in argvs]
    try:
        for proc in procs:
            if argvs[0][0] == "_pull" and proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"a bench helper did not start ({proc.poll()})")
        started = time.time()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        answers = [_json_line(proc) for proc in procs]
        for answer in answers:
            if "ended" in answer:
                answer["since_start"] = answer["ended"] - started
        return answers
    finally:
        for proc in procs:
            proc.wait(timeout=timeout)


def _wait_ready(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the synchronizer did not start ({proc.poll()})")
        time.sleep(0.1)


def _same_host(smoke: bool) -> float:
    argv = [sys.executable, str(ROOT / "bench" / "weight_plane.py")] + (["--smoke"] if smoke else ["--size-mib", "256"])
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["cut_through_vs_tcp"]


def measure(args, work: Path) -> dict:
    from flywheel.testing.link_emulator import EmulatedLink, available

    why_not = available()
    if why_not:
        raise SystemExit(f"cannot emulate the far link here: {why_not}")
    base_file, next_file, what = _versions(args, work)
    full = what["full_bytes"]
    report: dict = dict(what)
    with EmulatedLink(rate_bits=RATE_BITS, delay=DELAY, loss=LOSS) as link:
        ready = work / "synchronizer.ready.json"
        config = work / "synchronizer.yaml"
        config.write_text(json.dumps({"keep_versions": 2, "shared_memory_dir": "",
                                      "server": {"host": "0.0.0.0", "port": SYNC_PORT, "metrics_port": 0,
                                                 "ready_file": str(ready)}}))
        log = open(work / "synchronizer.log", "wb")  # noqa: SIM115 - closed with the link's processes
        sync = link.popen("near", [sys.executable, "-m", "services.synchronizer", "--config", str(config)],
                          cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _wait_ready(ready, sync)
        pusher = link.popen("near", [sys.executable, __file__, "_push", f"127.0.0.1:{SYNC_PORT}",
                                     str(base_file), str(next_file)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if pusher.stdout.readline().strip() != "pushed":
            raise SystemExit("pushing the versions failed")
        proxy = link.popen("near", [sys.executable, __file__, "_proxy", link.near_address], cwd=ROOT,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if proxy.stdout.readline().strip() != "listening":
            raise SystemExit("the forwarder did not start")
        direct, through_proxy = f"{link.near_address}:{SYNC_PORT}", f"{link.near_address}:{PROXY_PORT}"

        receiver = link.popen("far", [sys.executable, __file__, "_tcp_recv", link.far_address, str(full)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
        if receiver.stdout.readline().strip() != "listening":
            raise SystemExit("the TCP receiver did not start")
        tcp = _run(link, "near", "_tcp_send", link.far_address, str(full))
        assert tcp["received"] == full, tcp
        report["full_tcp_seconds"] = round(tcp["seconds"], 3)

        full_pull = _run(link, "far", "_pull", direct, "2", str(next_file))
        compressed = _run(link, "far", "_pull", "--compress", direct, "2", str(next_file))
        cold = _run(link, "far", "_pull", direct, "2", str(next_file), "1", str(base_file))
        warm = _run(link, "far", "_pull", direct, "2", str(next_file), "1", str(base_file))
        for name, figures in (("full_pull", full_pull), ("compressed_pull", compressed), ("delta_pull_cold", cold),
                              ("delta_pull", warm)):
            if not figures["exact"]:
                raise SystemExit(f"{name}: the pulled version is not version N bit for bit")
            report[f"{name}_seconds"] = round(figures["seconds"], 3)
            report[f"{name}_stream_bytes"] = figures["stream_bytes"]
        if cold["delta_base"] != 1 or warm["delta_base"] != 1:
            raise SystemExit(f"the synchronizer sent the full version instead of a delta: {cold}, {warm}")

        proxy.stdin.write("bytes\n")
        proxy.stdin.flush()
        before = json.loads(proxy.stdout.readline())["downstream"]
        proxy.stdin.write(f"cut {full // 2}\n")
        proxy.stdin.flush()
        assert proxy.stdout.readline().strip() == "armed"
        resumed = _run(link, "far", "_pull", through_proxy, "2", str(next_file))
        proxy.stdin.write("bytes\n")
        proxy.stdin.flush()
        after = json.loads(proxy.stdout.readline())
        if not resumed["exact"] or resumed["resumes"] != 1 or after["cuts"] != 1:
            raise SystemExit(f"the cut pull did not resume into the version: {resumed}, {after}")
        report["resume_seconds"] = round(resumed["seconds"], 3)
        report["resume_wire_bytes"] = after["downstream"] - before
        # Four far replicas behind one relay at their site (it holds nothing yet: the full version crosses
        # once, cut-through) against one replica alone pulling across the link.
        relay_ready, relay_config = work / "relay.ready.json", work / "relay.yaml"
        relay_config.write_text(json.dumps({
            "keep_versions": 2, "shared_memory_dir": "",
            "server": {"host": "0.0.0.0", "port": RELAY_PORT, "metrics_port": 0, "ready_file": str(relay_ready)},
            "relay": {"upstream": direct, "site": "far", "advertise_address": f"{link.far_address}:{RELAY_PORT}"}}))
        relay_log = open(work / "relay.log", "wb")  # noqa: SIM115 - closed with the link's processes
        relay = link.popen("far", [sys.executable, "-m", "services.synchronizer", "--config", str(relay_config)],
                           cwd=ROOT, stdout=relay_log, stderr=subprocess.STDOUT)
        _wait_ready(relay_ready, relay)
        alone = _together(link, "far", [["_pull", direct, "2", str(next_file)]])[0]
        site = _together(link, "far", [["_pull", f"127.0.0.1:{RELAY_PORT}", "2", str(next_file)]] * REPLICAS)
        if not alone["exact"] or not all(r["exact"] for r in site):
            raise SystemExit("a replica behind the relay did not get version N bit for bit")
        report["one_alone_seconds"] = round(alone["since_start"], 3)
        report["relay_first_seconds"] = round(min(r["since_start"] for r in site), 3)
        report["relay_last_seconds"] = round(max(r["since_start"] for r in site), 3)
        report["link"] = {"rate_mbit": RATE_BITS / 1e6, "delay_ms_each_way": DELAY * 1e3, "loss": LOSS,
                          "stats": {k: vars(v) for k, v in link.stats().items()}}
    report["same_host_vs_tcp"] = _same_host(args.smoke)
    report["codec"] = _codec_rates(next_file)
    return report


def _codec_rates(path: Path) -> dict:
    """The chunk compressor on this version's bytes, here: its ratio, its speeds, and the link rate
    below which compressing the stream pays (compress, send and decompress one after the other:
    1/C + r/R + 1/D < 1/R, so R < (1 - r) / (1/C + 1/D))."""
    import zstandard

    from flywheel.codec.dtypes import byte_view
    from flywheel.transfer.compression import LEVEL

    state = _load(str(path))
    data = b"".join(bytes(byte_view(t)) for t in state.values())
    chunks = [data[i : i + (4 << 20)] for i in range(0, len(data), 4 << 20)]
    started = time.perf_counter()
    packed = [zstandard.ZstdCompressor(level=LEVEL).compress(c) for c in chunks]
    compress = len(data) / (time.perf_counter() - started)
    started = time.perf_counter()
    for c in packed:
        zstandard.ZstdDecompressor().decompress(c)
    decompress = len(data) / (time.perf_counter() - started)
    ratio = sum(map(len, packed)) / len(data)
    return {"ratio": round(ratio, 4), "compress_mb_s": round(compress / 1e6), "decompress_mb_s": round(decompress / 1e6),
            "pays_below_mb_s": round((1 - ratio) / (1 / compress + 1 / decompress) / 1e6)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        COMMANDS[sys.argv[1]](sys.argv[2:])
        return
    parser = bench_parser(__doc__)
    parser.add_argument("--run-dir", type=Path, help="take versions from this run's checkpoints instead of making a run")
    parser.add_argument("--from-step", type=int, default=1, help="version M, the far replica's (0: the base model)")
    parser.add_argument("--to-step", type=int, default=2, help="version N, the new one")
    args = parse_with_smoke(parser, "the tiny quickstart's first 2 versions, and bench/weight_plane.py's smoke (CI)")
    with tempfile.TemporaryDirectory(prefix="flywheel-far-sync-") as tmp:
        r = measure(args, Path(tmp))
    full = r["full_bytes"]
    print(f"\nversion {r['to_step']} from {r['from_step']}: {full / 2**20:.1f} MiB in bfloat16, over "
          f"{RATE_BITS / 1e6:g} Mbit/s, {DELAY * 2e3:g} ms round trip, {LOSS:.1%} loss")
    print(f"  raw TCP, full version     {r['full_tcp_seconds']:8.2f} s")
    print(f"  pull, full version        {r['full_pull_seconds']:8.2f} s")
    codec = r["codec"]
    print(f"  pull, compressed chunks   {r['compressed_pull_seconds']:8.2f} s   "
          f"{r['compressed_pull_stream_bytes'] / full:.1%} of the bytes (zstd here: {codec['compress_mb_s']} MB/s in, "
          f"{codec['decompress_mb_s']} MB/s out: pays below {codec['pays_below_mb_s']} MB/s)")
    print(f"  pull, delta (first asker) {r['delta_pull_cold_seconds']:8.2f} s   "
          f"{r['delta_pull_cold_stream_bytes'] / full:.1%} of the bytes")
    print(f"  pull, delta               {r['delta_pull_seconds']:8.2f} s")
    print(f"  pull cut at 50 %, resumed {r['resume_seconds']:8.2f} s   {r['resume_wire_bytes'] / full:.3f} copies sent")
    print(f"  one replica alone         {r['one_alone_seconds']:8.2f} s")
    print(f"  {REPLICAS} behind a relay, first  {r['relay_first_seconds']:8.2f} s, last {r['relay_last_seconds']:.2f} s")
    record("far_sync", {
        **cpu(), "smoke": args.smoke, "full_mib": round(full / 2**20, 1),
        "delta_fraction": round(r["delta_pull_stream_bytes"] / full, 4),
        "full_tcp_seconds": r["full_tcp_seconds"], "full_pull_seconds": r["full_pull_seconds"],
        "delta_pull_seconds": r["delta_pull_seconds"], "delta_pull_cold_seconds": r["delta_pull_cold_seconds"],
        "delta_vs_full_tcp": round(r["full_tcp_seconds"] / r["delta_pull_seconds"], 2),
        "delta_cold_vs_full_tcp": round(r["full_tcp_seconds"] / r["delta_pull_cold_seconds"], 2),
        "full_pull_vs_full_tcp": round(r["full_tcp_seconds"] / r["full_pull_seconds"], 3),
        "compressed_pull_vs_full_pull": round(r["full_pull_seconds"] / r["compressed_pull_seconds"], 3),
        "compression_pays_below_mb_s": r["codec"]["pays_below_mb_s"], "compressed_fraction": r["codec"]["ratio"],
        "resume_bytes_vs_one_copy": round(r["resume_wire_bytes"] / full, 3),
        "relay_last_vs_one": round(r["relay_last_seconds"] / r["one_alone_seconds"], 3),
        "same_host_vs_tcp": r["same_host_vs_tcp"],
    }, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
