"""Weight codec throughput, side by side with memcpy and a TCP loopback baseline.

Run manual:
    python bench/codec.py                  # 512 MiB bf16 state dict, 5 reps
    python bench/codec.py --size-mib 128 --reps 3 --chunk-mib 2

Measured in the same run, on the same bytes; every round runs each case once
in turn (so load changes on the host hit all alike); medians of --reps rounds
after a warm-up round:
  memcpy          dst.copy_(src) between two preallocated flat buffers.
  tcp loopback    a second process sendall()s the bytes in 1 MiB memoryview
                  slices over 127.0.0.1; this process recv_into()s a
                  preallocated buffer. The wire at its cheapest on one host.
  codec, message objects   (the acceptance figure: >= tcp loopback means the
                  codec never limits the wire) encode_state_dict (checksum
                  pass + digest) -> each chunk straight into
                  WeightAssembler.add (checksum verify, staging) -> commit
                  (digest verify, copy into preallocated destination
                  tensors); one chunk in flight at a time, as on a stream;
                  staging reused across versions, as a long-running receiver.
  codec, wire bytes        the same with serialized chunks
                  (serialized_chunks -> add_serialized): two payload copies
                  fewer, for transports that forward bytes as they are.
  codec, hand-over         wire bytes with no destination: commit hands the
                  staging over and the next version stages into the previous
                  one's tensors (a synchronizer recycling its oldest version):
                  no commit copy.
  codec over tcp  the codec end to end across the loopback wire: a sender
                  process encodes, frames and sends the wire bytes, this
                  process receives and assembles into preallocated tensors.
  encode only / decode only  each side alone (decode replays pre-encoded
                  chunks held in memory); in production the two sides run in
                  different processes, on different cores or hosts.
Ends with one JSON line of the figures (GB/s = 1e9 bytes/s).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import time
from collections.abc import Callable

import torch

from flywheel.codec import WeightAssembler, encode_state_dict
from flywheel.codec.encoder import GRPC_DEFAULT_MAX_MESSAGE_BYTES
from flywheel.common.v1 import common_pb2

MiB = 1 << 20
_SOCK_SLICE = MiB


def make_state(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
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


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Memcpy:
    """dst.copy_(src) between two preallocated flat buffers."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)

    def __call__(self) -> None:
        self.dst.copy_(self.src)


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
        self.nbytes = nbytes
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            self.proc = mp.get_context("spawn").Process(
                target=_tcp_sender, args=(listener.getsockname()[1], nbytes), daemon=True
            )
            self.proc.start()
            self.conn, _ = listener.accept()
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.view = memoryview(self.dst.numpy())

    def __call__(self) -> None:
        self.conn.sendall(b"g")
        got = 0
        while got < self.nbytes:
            n = self.conn.recv_into(self.view[got:], min(self.nbytes - got, 4 * _SOCK_SLICE))
            if n == 0:
                raise RuntimeError("sender closed the connection early")
            got += n

    def close(self) -> None:
        self.conn.sendall(b"q")
        self.conn.close()
        self.proc.join(timeout=30)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise RuntimeError("peer closed the connection early")
        got += n


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
    buffer and feeds it to the assembler, then commits into preallocated
    destination tensors. Equal to tcp loopback = the codec never limits it."""

    def __init__(self, state: dict[str, torch.Tensor], size_bytes: int, chunk_bytes: int) -> None:
        self.state = state
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            self.proc = mp.get_context("spawn").Process(
                target=_codec_sender, args=(listener.getsockname()[1], size_bytes, chunk_bytes), daemon=True
            )
            self.proc.start()
            self.conn, _ = listener.accept()
        self.dest = {k: torch.zeros_like(v) for k, v in state.items()}
        self.staging: dict[str, torch.Tensor] | None = None
        self.frame = memoryview(bytearray(GRPC_DEFAULT_MAX_MESSAGE_BYTES))
        self.head = memoryview(bytearray(4))

    def _frame_size(self) -> int:
        _recv_exact(self.conn, self.head)
        return struct.unpack("<I", self.head)[0]

    def __call__(self) -> None:
        self.conn.sendall(b"g")
        manifest = memoryview(bytearray(self._frame_size()))
        _recv_exact(self.conn, manifest)
        asm = WeightAssembler(common_pb2.WeightManifest.FromString(manifest), self.dest, staging=self.staging)
        for _ in range(asm.manifest.chunk_count):
            frame = self.frame[: self._frame_size()]
            _recv_exact(self.conn, frame)
            asm.add_serialized(frame)
        asm.commit()
        self.staging = asm.staging

    def check(self) -> None:
        for k, v in self.state.items():
            if not torch.equal(self.dest[k].view(torch.int16), v.view(torch.int16)):
                raise AssertionError(f"codec over tcp differs on {k}")

    def close(self) -> None:
        self.conn.sendall(b"q")
        self.conn.close()
        self.proc.join(timeout=30)


class Codec:
    """One version: encode -> chunk by chunk into the assembler -> commit.

    One chunk is in flight at a time, as on a real stream. wire=False passes
    WeightChunk message objects; wire=True passes their serialized bytes
    (`serialized_chunks` -> `add_serialized`), as a transport that forwards
    bytes as-is does, saving the message objects' payload copies.
    handover=False commits into preallocated destination tensors (a rollout
    engine's weights) and reuses its staging; handover=True has no destination:
    commit hands the staging tensors over, and the next version stages into
    the previous version's tensors (a synchronizer recycling its oldest
    buffered version), so there is no commit copy at all.
    """

    def __init__(self, state: dict[str, torch.Tensor], chunk_bytes: int, wire: bool, handover: bool = False) -> None:
        self.state, self.chunk_bytes, self.wire, self.handover = state, chunk_bytes, wire, handover
        self.dest = None if handover else {k: torch.zeros_like(v) for k, v in state.items()}
        self.staging: dict[str, torch.Tensor] | None = None
        self.result: dict[str, torch.Tensor] = {}
        self.version = 0

    def __call__(self) -> None:
        self.version += 1
        enc = encode_state_dict(self.state, self.version, chunk_bytes=self.chunk_bytes)
        asm = WeightAssembler(enc.manifest, self.dest, staging=self.staging)
        if self.wire:
            for raw in enc.serialized_chunks():
                asm.add_serialized(raw)
        else:
            for chunk in enc.chunks():
                asm.add(chunk)
        self.result = asm.commit()
        # Destination: keep staging for the next version. Hand-over: the
        # result is the new version; the previous one is recycled as staging.
        self.staging = asm.staging if not self.handover else self._previous
        self._previous = self.result if self.handover else None

    _previous: dict[str, torch.Tensor] | None = None

    def check(self) -> None:
        for k, v in self.state.items():  # the benchmark must not time a broken codec
            if not torch.equal(self.result[k].view(torch.int16), v.view(torch.int16)):
                raise AssertionError(f"codec round trip differs on {k}")


def encode_only(state: dict[str, torch.Tensor], chunk_bytes: int, wire: bool) -> Callable[[], None]:
    def run() -> None:
        enc = encode_state_dict(state, 1, chunk_bytes=chunk_bytes)
        for _ in enc.serialized_chunks() if wire else enc.chunks():
            pass

    return run


def decode_only(state: dict[str, torch.Tensor], chunk_bytes: int, wire: bool) -> Callable[[], None]:
    """Replays pre-encoded chunks (all held in memory: a measurement aid only)."""
    enc = encode_state_dict(state, 1, chunk_bytes=chunk_bytes)
    chunks = list(enc.serialized_chunks() if wire else enc.chunks())
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    staging = WeightAssembler(enc.manifest).staging

    def run() -> None:
        asm = WeightAssembler(enc.manifest, dest, staging=staging)
        add = asm.add_serialized if wire else asm.add
        for chunk in chunks:
            add(chunk)
        asm.commit()

    return run


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512, help="state dict size, MiB")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per figure (median)")
    parser.add_argument("--chunk-mib", type=float, default=1.0, help="codec chunk payload, MiB")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    state = make_state(args.size_mib * MiB)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    chunk_bytes = int(args.chunk_mib * MiB)

    tcp = TcpLoopback(nbytes)
    over_tcp = CodecOverTcp(state, args.size_mib * MiB, chunk_bytes)
    codecs = {
        "codec": Codec(state, chunk_bytes, wire=False),
        "codec_wire": Codec(state, chunk_bytes, wire=True),
        "codec_wire_handover": Codec(state, chunk_bytes, wire=True, handover=True),
    }
    seconds = interleaved({"memcpy": Memcpy(nbytes), "tcp": tcp, "codec_over_tcp": over_tcp, **codecs}, args.reps)
    tcp.close()
    over_tcp.close()
    for case in [over_tcp, *codecs.values()]:
        case.check()
    del tcp, over_tcp, codecs
    seconds |= interleaved(
        {
            "encode": encode_only(state, chunk_bytes, wire=False),
            "decode": decode_only(state, chunk_bytes, wire=False),
            "encode_wire": encode_only(state, chunk_bytes, wire=True),
            "decode_wire": decode_only(state, chunk_bytes, wire=True),
        },
        args.reps,
    )
    gbps = {k: nbytes / v / 1e9 for k, v in seconds.items()}
    # Other processes compete for the same cores and memory bandwidth; the
    # interleaving keeps the comparison fair, the load says how noisy it was.
    load = (load_before, os.getloadavg()[0])

    print(
        f"state dict: {len(state)} bf16 tensors, {nbytes / MiB:.1f} MiB; chunk {args.chunk_mib:g} MiB; "
        f"median of {args.reps}; torch threads {torch.get_num_threads()}; "
        f"host load (1 min) {load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} cores"
    )
    print(f"{'path':<48}{'GB/s':>8}{'vs tcp':>9}")
    for key, label in [
        ("memcpy", "memcpy (dst.copy_(src))"),
        ("tcp", "tcp loopback (2 processes)"),
        ("codec_over_tcp", "codec end to end over tcp loopback"),
        ("codec", "codec encode+decode, message objects"),
        ("codec_wire", "codec encode+decode, wire bytes"),
        ("codec_wire_handover", "codec encode+decode, hand-over (no commit copy)"),
        ("encode", "  encode only, message objects"),
        ("decode", "  decode only, message objects"),
        ("encode_wire", "  encode only, wire bytes"),
        ("decode_wire", "  decode only, wire bytes"),
    ]:
        print(f"{label:<48}{gbps[key]:>8.2f}{gbps[key] / gbps['tcp']:>8.2f}x")
    figures = {
        "bytes": nbytes,
        "chunk_bytes": chunk_bytes,
        "memcpy_gbps": gbps["memcpy"],
        "tcp_loopback_gbps": gbps["tcp"],
        "codec_gbps": gbps["codec"],
        "codec_wire_gbps": gbps["codec_wire"],
        "codec_vs_tcp_loopback": gbps["codec"] / gbps["tcp"],
        "codec_wire_vs_tcp_loopback": gbps["codec_wire"] / gbps["tcp"],
        "codec_wire_handover_gbps": gbps["codec_wire_handover"],
        "codec_over_tcp_gbps": gbps["codec_over_tcp"],
        "codec_over_tcp_vs_tcp_loopback": gbps["codec_over_tcp"] / gbps["tcp"],
        "codec_vs_memcpy": gbps["codec"] / gbps["memcpy"],
    }
    for key in ("encode", "decode", "encode_wire", "decode_wire"):
        figures[f"{key}_gbps"] = gbps[key]
    figures["host_load_1m"] = max(load)
    print(json.dumps({k: v if isinstance(v, int) else round(v, 3) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
