"""Weight codec throughput, side by side with memcpy and a TCP loopback baseline.

Run manual:
    python bench/codec.py                  # 512 MiB bf16 state dict, 5 reps
    python bench/codec.py --size-mib 128 --reps 3 --chunk-mib 2
    python bench/codec.py --smoke    # seconds: checks it runs (CI)

Measured in the same run, on the same bytes; every round runs each case once
in turn (so load changes on the host hit all alike); medians of --reps rounds
after a warm-up round:
  memcpy          dst.copy_(src) of every tensor into the preallocated
                  destination tensors the codec cases commit into.
  tcp loopback    a second process sendall()s the bytes in 1 MiB memoryview
                  slices over 127.0.0.1; this process recv_into()s a
                  preallocated buffer. The wire at its cheapest on one host.
  codec, message objects   encode_state_dict (checksum pass + digest) ->
                  each chunk straight into WeightAssembler.add (checksum verify, staging) -> commit
                  (digest verify, copy into preallocated destination
                  tensors); one chunk in flight at a time, as on a stream;
                  staging reused across versions, as a long-running receiver.
  codec, wire bytes        the same with serialized chunks
                  (serialized_chunks -> add_serialized): two payload copies
                  fewer, for transports that forward bytes as they are.
  codec, pieces            the in-process form: the encoder's (header,
                  payload view) pieces straight into add_piece, no wire bytes
                  at all; checksums made and verified, commit into the
                  preallocated destination as above.
  codec, pieces, background   (the acceptance figure: the codec's own
                  in-process encode+decode; >= tcp loopback means the codec
                  itself never limits the wire) the same with
                  stage_in_background: the staging copies and checksum
                  checks run on the codec's pool while this thread checks
                  the next headers.
  codec, hand-over         wire bytes with no destination: commit hands the
                  staging over and the next version stages into the previous
                  one's tensors (a synchronizer recycling its oldest version):
                  no commit copy.
  codec over tcp  the codec end to end across the loopback wire: a sender
                  process encodes, frames and sends the wire bytes, this
                  process receives and assembles into preallocated tensors.
  encode only     the sender side alone; decode is derived as (encode+decode)
                  minus encode only. In production the two sides run in
                  different processes, on different cores or hosts.
Memory: about 6x --size-mib in this process plus 1x in each sender process
(destination and staging tensors are shared by the cases; each case is
verified bit-exact on its own before timing starts).
Ends with one JSON line of the figures (GB/s = 1e9 bytes/s).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from flywheel.codec import WeightAssembler, encode_state_dict  # noqa: E402
from flywheel.codec.encoder import GRPC_DEFAULT_MAX_MESSAGE_BYTES  # noqa: E402
from flywheel.common.v1 import common_pb2  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

MiB = 1 << 20
_SOCK_SLICE = MiB
State = dict[str, torch.Tensor]


def make_state(size_bytes: int, seed: int = 0) -> State:
    """A transformer-like bf16 state dict of about size_bytes: an embedding,
    per layer four attention and three MLP matrices plus two norm vectors and
    biases, and a final norm. Random bit patterns (NaNs and infs included)."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = 1024, 2816, 32000
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    total, layer = vocab * hidden * 2, 0
    while total < size_bytes:
        p = f"model.layers.{layer}."
        for name, shape in [
            ("input_layernorm.weight", (hidden,)),
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.q_proj.bias", (hidden,)),
            ("self_attn.k_proj.weight", (hidden // 4, hidden)),
            ("self_attn.k_proj.bias", (hidden // 4,)),
            ("self_attn.v_proj.weight", (hidden // 4, hidden)),
            ("self_attn.v_proj.bias", (hidden // 4,)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("post_attention_layernorm.weight", (hidden,)),
            ("mlp.gate_proj.weight", (inter, hidden)),
            ("mlp.up_proj.weight", (inter, hidden)),
            ("mlp.down_proj.weight", (hidden, inter)),
        ]:
            shapes.append((p + name, shape))
            total += 2 * torch.Size(shape).numel()
        layer += 1
    shapes.append(("model.norm.weight", (hidden,)))
    state = {}
    for name, shape in shapes:
        bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g)
        state[name] = bits.view(torch.bfloat16)
    return state


def same_bits(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


# -- baselines -----------------------------------------------------------------


class Memcpy:
    """dst.copy_(src) for every tensor, into preallocated tensors."""

    def __init__(self, state: State, dest: State) -> None:
        self.state, self.dest = state, dest

    def __call__(self) -> None:
        for name, src in self.state.items():
            self.dest[name].copy_(src)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, 4 * _SOCK_SLICE))
        if n == 0:
            raise RuntimeError("peer closed the connection early")
        got += n


def _listen_for(target: Callable[..., None], *args: object) -> tuple[socket.socket, mp.process.BaseProcess]:
    """Start `target(port, *args)` in a fresh process and accept its connection."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        proc = mp.get_context("spawn").Process(target=target, args=(listener.getsockname()[1], *args), daemon=True)
        proc.start()
        conn, _ = listener.accept()
    return conn, proc


def _tcp_sender(port: int, nbytes: int) -> None:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    view = memoryview(src.numpy())
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while s.recv(1) == b"g":
            for i in range(0, nbytes, _SOCK_SLICE):
                s.sendall(view[i : i + _SOCK_SLICE])


class TcpLoopback:
    """One transfer of nbytes from a sender process, recv_into a preallocated buffer."""

    def __init__(self, nbytes: int) -> None:
        self.conn, self.proc = _listen_for(_tcp_sender, nbytes)
        self.view = memoryview(torch.zeros(nbytes, dtype=torch.uint8).numpy())

    def __call__(self) -> None:
        self.conn.sendall(b"g")
        _recv_exact(self.conn, self.view)

    def close(self) -> None:
        self.conn.sendall(b"q")
        self.conn.close()
        self.proc.join(timeout=30)


# -- codec cases ---------------------------------------------------------------


class Codec:
    """One version: encode -> chunk by chunk into the assembler -> commit.

    One chunk is in flight at a time, as on a real stream. wire=False passes
    WeightChunk message objects; wire=True passes their serialized bytes
    (`serialized_chunks` -> `add_serialized`), as a transport that forwards
    bytes as-is does, saving the message objects' payload copies.
    With `dest`, commit copies into those preallocated tensors (a rollout
    engine's weights) and staging is reused across versions. Without, commit
    hands the staging tensors over and the next version stages into the
    previous version's tensors (a synchronizer recycling its oldest buffered
    version): no commit copy at all.
    """

    def __init__(
        self, state: State, chunk_bytes: int, wire: bool | str, dest: State | None, staging: State | None,
        background: bool = False,
    ) -> None:
        self.state, self.chunk_bytes, self.wire = state, chunk_bytes, wire
        self.dest, self.staging, self.background = dest, staging, background
        self.result: State = {}
        self.previous: State | None = None
        self.version = 0

    def __call__(self) -> None:
        self.version += 1
        enc = encode_state_dict(self.state, self.version, chunk_bytes=self.chunk_bytes)
        asm = WeightAssembler(enc.manifest, self.dest, staging=self.staging, stage_in_background=self.background)
        if self.wire == "pieces":
            for header, payload in enc.pieces():
                asm.add_piece(header, payload)
        elif self.wire:
            for raw in enc.serialized_chunks():
                asm.add_serialized(raw)
        else:
            for chunk in enc.chunks():
                asm.add(chunk)
        self.result = asm.commit()
        if self.dest is None:
            self.staging, self.previous = self.previous, self.result
        else:
            self.staging = asm.staging


class PipelinedCodec:
    """Encode and decode of one version running together, as on a stream:
    an encoder thread serializes chunks into a bounded queue (4 in flight)
    while this thread assembles them into the preallocated destination and
    commits. The TCP baseline also has two sides working at once (two
    processes); this is the codec's throughput as a stream sees it."""

    def __init__(self, state: State, chunk_bytes: int, dest: State, staging: State) -> None:
        self.state, self.chunk_bytes, self.dest, self.staging = state, chunk_bytes, dest, staging
        self.result: State = {}
        self.version = 0

    def __call__(self) -> None:
        self.version += 1
        chunks: queue.Queue = queue.Queue(maxsize=4)
        manifests: queue.Queue = queue.Queue(maxsize=1)

        def produce() -> None:
            try:
                enc = encode_state_dict(self.state, self.version, chunk_bytes=self.chunk_bytes)
                manifests.put(enc.manifest)
                for raw in enc.serialized_chunks():
                    chunks.put(raw)
            finally:
                chunks.put(None)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        asm = WeightAssembler(manifests.get(timeout=60), self.dest, staging=self.staging)
        while (raw := chunks.get(timeout=60)) is not None:
            asm.add_serialized(raw)
        producer.join()
        self.result = asm.commit()


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    """4-byte little-endian length, then the payload (scatter-gather, no concat)."""
    parts = [memoryview(struct.pack("<I", len(payload))), memoryview(payload)]
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts:
            parts[0] = parts[0][sent:]


def _codec_sender(port: int, size_bytes: int, chunk_bytes: int) -> None:
    state = make_state(size_bytes)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        version = 0
        while s.recv(1) == b"g":
            version += 1
            enc = encode_state_dict(state, version, chunk_bytes=chunk_bytes)
            _send_frame(s, enc.manifest.SerializeToString())
            for raw in enc.serialized_chunks():
                _send_frame(s, raw)


class CodecOverTcp:
    """The codec end to end over the same loopback wire as TcpLoopback: a
    sender process encodes each version and sends its wire-bytes chunks as
    length-prefixed frames; this process receives each frame into one reused
    buffer, feeds it to the assembler and commits into preallocated tensors.
    Equal to tcp loopback would mean the codec costs the wire nothing."""

    def __init__(self, size_bytes: int, chunk_bytes: int, dest: State, staging: State) -> None:
        self.conn, self.proc = _listen_for(_codec_sender, size_bytes, chunk_bytes)
        self.dest, self.staging = dest, staging
        self.result: State = {}
        self.frame = memoryview(bytearray(GRPC_DEFAULT_MAX_MESSAGE_BYTES))
        self.head = memoryview(bytearray(4))

    def _frame(self) -> memoryview:
        _recv_exact(self.conn, self.head)
        size = struct.unpack("<I", self.head)[0]
        frame = self.frame[:size] if size <= len(self.frame) else memoryview(bytearray(size))
        _recv_exact(self.conn, frame)
        return frame

    def __call__(self) -> None:
        self.conn.sendall(b"g")
        manifest = common_pb2.WeightManifest.FromString(self._frame())
        asm = WeightAssembler(manifest, self.dest, staging=self.staging)
        for _ in range(manifest.chunk_count):
            asm.add_serialized(self._frame())
        self.result = asm.commit()

    def close(self) -> None:
        self.conn.sendall(b"q")
        self.conn.close()
        self.proc.join(timeout=30)


class EncodeOnly:
    def __init__(self, state: State, chunk_bytes: int, wire: bool) -> None:
        self.state, self.chunk_bytes, self.wire = state, chunk_bytes, wire

    def __call__(self) -> None:
        enc = encode_state_dict(self.state, 1, chunk_bytes=self.chunk_bytes)
        for _ in enc.serialized_chunks() if self.wire else enc.chunks():
            pass


# -- driver --------------------------------------------------------------------


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(cases: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds per case: one warm-up round, then the cases take turns
    in every round, so load changes on the host hit every case alike."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def verify(cases: dict[str, Codec | CodecOverTcp], state: State, dest: State) -> None:
    """Run every codec case once on a zeroed destination: the benchmark must
    not time a codec that is wrong (cases share the destination tensors)."""
    for name, case in cases.items():
        for t in dest.values():
            t.view(torch.int16).fill_(0)
        case()
        if not same_bits(case.result, state):
            raise AssertionError(f"{name}: the round trip is not bit-exact")


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--size-mib", type=int, default=512, help="state dict size, MiB")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per figure (median)")
    parser.add_argument("--chunk-mib", type=float, default=1.0, help="codec chunk payload, MiB")
    args = parse_with_smoke(parser, "the smallest state dict, one repetition: checks the bench runs (CI)",
                            size_mib=16, reps=1)

    load_before = os.getloadavg()[0]
    state = make_state(args.size_mib * MiB)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    chunk_bytes = int(args.chunk_mib * MiB)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    staging = {k: torch.zeros_like(v) for k, v in state.items()}

    tcp = TcpLoopback(nbytes)
    over_tcp = CodecOverTcp(args.size_mib * MiB, chunk_bytes, dest, staging)
    codecs: dict[str, Codec | CodecOverTcp] = {
        "codec": Codec(state, chunk_bytes, wire=False, dest=dest, staging=staging),
        "codec_wire": Codec(state, chunk_bytes, wire=True, dest=dest, staging=staging),
        "codec_handover": Codec(state, chunk_bytes, wire=True, dest=None, staging=None),
        "codec_pieces": Codec(state, chunk_bytes, wire="pieces", dest=dest, staging=staging),
        "codec_pieces_background": Codec(state, chunk_bytes, wire="pieces", dest=dest, staging=staging, background=True),
        "codec_pipelined": PipelinedCodec(state, chunk_bytes, dest, staging),
        "codec_over_tcp": over_tcp,
    }
    verify(codecs, state, dest)
    seconds = interleaved(
        {
            "memcpy": Memcpy(state, dest),
            "tcp": tcp,
            **codecs,
            "encode": EncodeOnly(state, chunk_bytes, wire=False),
            "encode_wire": EncodeOnly(state, chunk_bytes, wire=True),
        },
        args.reps,
    )
    tcp.close()
    over_tcp.close()
    gbps = {k: nbytes / v / 1e9 for k, v in seconds.items()}
    gbps["decode"] = nbytes / max(seconds["codec"] - seconds["encode"], 1e-9) / 1e9
    gbps["decode_wire"] = nbytes / max(seconds["codec_wire"] - seconds["encode_wire"], 1e-9) / 1e9
    # Other processes compete for the same cores and memory bandwidth; the
    # interleaving keeps the comparison fair, the load says how noisy it was.
    load = (load_before, os.getloadavg()[0])

    print(
        f"state dict: {len(state)} bf16 tensors, {nbytes / MiB:.1f} MiB; chunk {args.chunk_mib:g} MiB; "
        f"median of {args.reps}; torch threads {torch.get_num_threads()}; "
        f"host load (1 min) {load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} cores"
    )
    print(f"{'path':<52}{'GB/s':>8}{'vs tcp':>9}")
    for key, label in [
        ("memcpy", "memcpy (dst.copy_(src))"),
        ("tcp", "tcp loopback (2 processes)"),
        ("codec", "codec encode+decode, message objects"),
        ("codec_wire", "codec encode+decode, wire bytes"),
        ("codec_handover", "codec encode+decode, wire bytes, hand-over"),
        ("codec_pieces", "codec encode+decode, pieces (in-process, no wire)"),
        ("codec_pieces_background", "codec encode+decode, pieces, background staging"),
        ("codec_pipelined", "codec encode | decode pipelined (2 threads)"),
        ("codec_over_tcp", "codec end to end over tcp loopback (2 processes)"),
        ("encode", "  encode only, message objects"),
        ("decode", "  decode (derived), message objects"),
        ("encode_wire", "  encode only, wire bytes"),
        ("decode_wire", "  decode (derived), wire bytes"),
    ]:
        print(f"{label:<52}{gbps[key]:>8.2f}{gbps[key] / gbps['tcp']:>8.2f}x")
    figures = {"bytes": nbytes, "chunk_bytes": chunk_bytes, "memcpy_gbps": gbps["memcpy"], "tcp_loopback_gbps": gbps["tcp"]}
    # Each way of the codec against the tcp loopback wire: the codec must never be what limits the wire.
    for way in ("codec", "codec_wire", "codec_handover", "codec_pieces", "codec_pieces_background", "codec_pipelined",
                "codec_over_tcp"):
        figures[f"{way}_gbps"] = gbps[way]
        figures[f"{way}_vs_tcp_loopback"] = gbps[way] / gbps["tcp"]
    figures["codec_vs_memcpy"] = gbps["codec"] / gbps["memcpy"]
    for side in ("encode", "decode", "encode_wire", "decode_wire"):
        figures[f"{side}_gbps"] = gbps[side]
    figures["host_load_1m"] = max(load)
    record("codec", {k: v if isinstance(v, int) else round(v, 3) for k, v in figures.items()}, args=args,
           smoke=args.smoke)


if __name__ == "__main__":
    main()
