"""The rollout's OpenAI HTTP API under many concurrent clients: errors, latency, memory, tokens/s.

Run manual:
    python bench/load.py                                # tiny model, 256 clients for 60 s (~2 minutes on 2 cores)
    python bench/load.py --smoke                        # 16 clients for 3 s: checks it runs (CI)
    python bench/load.py --max-pending-requests 512     # the service's default limit: 256 clients are never refused
    python bench/load.py --model smollm2 --clients 64 --max-tokens 32

A real rollout (`python -m services.rollout`, vLLM on CPU, with bench/rollout.py's
model and engine arguments) and, in this process, aiohttp clients, each looping
on requests until the window ends: a quarter each of /v1/completions and
/v1/chat/completions, streamed and not (temperature 1, max_tokens M,
ignore_eos: every served request is M tokens). Each attempt has a deadline
(--deadline). A 429 is slept off for its Retry-After and retried, as OpenAI's
clients do; a client whose wait outlasts the window stops there. Past the
window no request starts; those in flight finish.

The admission limit is --max-pending-requests 128 (the service's default is
512): with 256 clients, about half are refused at any moment, so the 429 path is
exercised; it equals the engine's batch (max_num_seqs), so what is admitted runs.

Phases, in turn, on the same service:
  warm-up   --baseline-clients clients for --warmup-seconds (5), untimed.
  unloaded  --baseline-clients (16) clients for --baseline-seconds: the baseline.
            16 is well under the engine's batch and the admission limit, so
            nothing queues or is refused, while the engine still batches; one
            client at a time would measure one sequence's step latency, which
            any batching server beats many times over.
  load      --clients (256) clients for --seconds (60).
  unloaded  again: the baseline is the mean of both unloaded runs, so a drift
            of the machine's load falls on both sides, and a service the load
            left slower shows here.
Tokens/s of a phase: completion tokens of the requests it served over the wall
time from its start until its last request ended.

Reported for the load: requests served, attempts, 429s (each with a
Retry-After; one without is an error), errors by kind (anything else: another
status, a timeout, a broken connection, a stream with an error event or
without [DONE], a body without the M tokens asked for), latency p50/p99 of the
served requests and time to first token of the streamed ones, both from the
first attempt (Retry-After waits included: what a client sees); the rollout's
RSS, sampled every 0.5 s, before the load, its peak during it, and after (and
how much the peak of the load's second half exceeds its first half's: a leak
keeps growing): the service process and its children (vLLM's engine core and
CPU worker) summed (pages they share, ~200 MB each, counted in each), and the
service process alone; and whether /health answers 200 after everything. Ends
with one JSON line; the ratio is `loaded_tokens_per_s_vs_unloaded`. Exits 1
(after the JSON) when any request erred, the ratio is under 0.5, or the
service does not answer /health.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from bench.rollout import TOKEN, engine_args, http_port_of, prepare_model, start_rollout  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

#: (path, stream) of client i is KINDS[i % 4].
KINDS = (("/v1/completions", False), ("/v1/completions", True), ("/v1/chat/completions", False),
         ("/v1/chat/completions", True))
#: A client's pause after an error, so a dead server is not hammered in a tight loop.
ERROR_BACKOFF_SECONDS = 1.0
MIN_RATIO = 0.5


@dataclass
class Tally:
    """What one phase's clients saw."""

    served: int = 0
    tokens: int = 0
    attempts: int = 0
    rejected: int = 0  # 429 with a Retry-After
    gave_up_at_end: int = 0  # waiting out a Retry-After when the window closed
    errors: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    wall: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


class RssSampler:
    """RSS of a process with its children summed, and of the process alone, every `interval` seconds in a
    thread of its own."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.process, self.interval = psutil.Process(pid), interval
        self.samples: list[tuple[float, tuple[int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> tuple[int, int]:
        """(with children, alone) in bytes."""
        try:
            procs = [self.process, *self.process.children(recursive=True)]
            alone = self.process.memory_info().rss
        except psutil.NoSuchProcess:
            return 0, 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total, alone

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((time.perf_counter(), self.now()))

    def peak(self, since: float, until: float) -> tuple[int, int]:
        window = [rss for t, rss in self.samples if since <= t <= until] or [(0, 0)]
        return max(total for total, _ in window), max(alone for _, alone in window)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def request_body(path: str, stream: bool, client: int, n: int, max_tokens: int) -> dict:
    text = f"Question {client}.{n}: what is {(client * 7 + n) % 91} + {(client * 13 + n) % 57}? Think step by step."
    body: dict = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if path == "/v1/completions":
        return {**body, "prompt": text}
    return {**body, "messages": [{"role": "user", "content": text}]}


async def attempt(session: aiohttp.ClientSession, path: str, body: dict, deadline: float) -> tuple[str, object, float | None]:
    """One try: ("ok", completion tokens, time of the first token or None), ("retry", seconds) or ("error", kind)."""
    first = None
    try:
        async with session.post(path, json=body, timeout=aiohttp.ClientTimeout(total=deadline)) as r:
            if r.status == 429:
                await r.read()
                try:
                    return "retry", float(r.headers["Retry-After"]), None
                except (KeyError, ValueError):
                    return "error", "429_without_retry_after", None
            if r.status // 100 != 2:
                await r.read()
                return "error", f"http_{r.status}", None
            if not body["stream"]:
                tokens = ((await r.json()).get("usage") or {}).get("completion_tokens")
            else:
                tokens, done = None, False
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        return "error", "stream_error_event", None
                    if first is None and any(c.get("token_ids") for c in chunk.get("choices") or ()):
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                if not done:
                    return "error", "stream_without_done", None
    except asyncio.TimeoutError:
        return "error", "timeout", None
    except aiohttp.ClientError as exc:
        return "error", f"connection_{type(exc).__name__}", None
    except json.JSONDecodeError:
        return "error", "bad_json", None
    if tokens != body["max_tokens"] or (body["stream"] and first is None):
        return "error", "wrong_token_count", None
    return "ok", tokens, first


async def client(session: aiohttp.ClientSession, i: int, end: float, max_tokens: int, deadline: float,
                 tally: Tally) -> None:
    path, stream = KINDS[i % len(KINDS)]
    n = 0
    while time.perf_counter() < end:
        body = request_body(path, stream, i, n, max_tokens)
        n += 1
        start = time.perf_counter()
        while True:
            tally.attempts += 1
            outcome, value, first = await attempt(session, path, body, deadline)
            if outcome != "retry":
                break
            tally.rejected += 1
            if time.perf_counter() + value >= end:
                tally.gave_up_at_end += 1
                return
            await asyncio.sleep(value)
        if outcome == "ok":
            tally.served += 1
            tally.tokens += value
            tally.latencies.append(time.perf_counter() - start)
            if stream:
                tally.ttfts.append(first - start)
        else:
            tally.errors[value] += 1
            await asyncio.sleep(ERROR_BACKOFF_SECONDS)


async def phase(url: str, clients: int, seconds: float, max_tokens: int, deadline: float) -> Tally:
    tally = Tally()
    # One connection per client, as many separate OpenAI clients would hold.
    async with aiohttp.ClientSession(url, headers={"Authorization": f"Bearer {TOKEN}"},
                                     connector=aiohttp.TCPConnector(limit=clients)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session, i, start + seconds, max_tokens, deadline, tally) for i in range(clients)))
        tally.wall = time.perf_counter() - start
    return tally


async def healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession(url) as session:
            async with session.get("/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                return r.status == 200 and (await r.json()).get("status") == "ok"
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def percentile(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return round(values[0], 3) if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def report(name: str, tally: Tally) -> None:
    print(f"{name}: {tally.served} served in {tally.wall:.1f} s, {tally.tokens_per_s:.0f} tokens/s, "
          f"{tally.rejected} 429s, errors {dict(tally.errors)}, latency p50 {percentile(tally.latencies, 50)} s "
          f"p99 {percentile(tally.latencies, 99)} s", file=sys.stderr)


async def bench(url: str, rss: RssSampler, opts: argparse.Namespace) -> dict:
    base = (opts.baseline_clients, opts.baseline_seconds, opts.max_tokens, opts.deadline)
    report("warm-up", await phase(url, opts.baseline_clients, opts.warmup_seconds, opts.max_tokens, opts.deadline))
    before = await phase(url, *base)
    report("unloaded (before)", before)
    rss_before = rss.now()
    start = time.perf_counter()
    load = await phase(url, opts.clients, opts.seconds, opts.max_tokens, opts.deadline)
    end = time.perf_counter()
    rss_peak = tuple(map(max, rss.peak(start, end), rss_before))
    # A leak keeps growing through the window; buffers sized for the larger batch stop early.
    mid = start + opts.seconds / 2
    rss_growth = rss.peak(mid, end)[0] - rss.peak(start, mid)[0]
    rss_after = rss.now()
    report("load", load)
    after = await phase(url, *base)
    report("unloaded (after)", after)
    unloaded = (before.tokens_per_s + after.tokens_per_s) / 2
    mb = 2**20
    return {
        "requests_served": load.served, "attempts": load.attempts, "rejected_429": load.rejected,
        "gave_up_at_end": load.gave_up_at_end, "errors": dict(load.errors), "errors_total": sum(load.errors.values()),
        "unloaded_errors_total": sum(before.errors.values()) + sum(after.errors.values()),
        "latency_p50_s": percentile(load.latencies, 50), "latency_p99_s": percentile(load.latencies, 99),
        "ttft_p50_s": percentile(load.ttfts, 50), "ttft_p99_s": percentile(load.ttfts, 99),
        "unloaded_latency_p50_s": percentile(before.latencies + after.latencies, 50),
        "loaded_seconds": round(load.wall, 1),
        "loaded_tokens_per_s": round(load.tokens_per_s, 1),
        "unloaded_before_tokens_per_s": round(before.tokens_per_s, 1),
        "unloaded_after_tokens_per_s": round(after.tokens_per_s, 1),
        "unloaded_tokens_per_s": round(unloaded, 1),
        "loaded_tokens_per_s_vs_unloaded": round(load.tokens_per_s / unloaded, 3) if unloaded else 0.0,
        "rss_before_mb": round(rss_before[0] / mb), "rss_peak_mb": round(rss_peak[0] / mb),
        "rss_after_mb": round(rss_after[0] / mb), "rss_second_half_growth_mb": round(rss_growth / mb),
        "rss_service_alone_before_mb": round(rss_before[1] / mb),
        "rss_service_alone_peak_mb": round(rss_peak[1] / mb), "rss_service_alone_after_mb": round(rss_after[1] / mb),
    }


def failures(figures: dict) -> list[str]:
    found = []
    if figures["errors_total"] or figures["unloaded_errors_total"]:
        found.append(f"errors: {figures['errors']} under load, {figures['unloaded_errors_total']} unloaded")
    if figures["loaded_tokens_per_s_vs_unloaded"] < MIN_RATIO:
        found.append(f"loaded tokens/s under {MIN_RATIO} of unloaded")
    if not figures["health_after"]:
        found.append("the service does not answer /health after the load")
    return found


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--clients", type=int, default=256, help="concurrent clients under load")
    parser.add_argument("--seconds", type=float, default=60.0, help="the load's window")
    parser.add_argument("--max-tokens", type=int, default=64, help="completion tokens of every request")
    parser.add_argument("--max-pending-requests", type=int, default=128, help="the rollout's admission limit (samples)")
    parser.add_argument("--baseline-clients", type=int, default=16, help="concurrent clients of the unloaded runs")
    parser.add_argument("--baseline-seconds", type=float, default=15.0, help="window of each unloaded run")
    parser.add_argument("--deadline", type=float, default=120.0, help="every attempt's deadline, in seconds")
    parser.add_argument("--warmup-seconds", type=float, default=5.0, help="the untimed warm-up's window")
    opts = parse_with_smoke(parser, "16 clients for 3 s: checks the bench runs (CI)",
                            clients=16, seconds=3.0, max_pending_requests=8,
                            baseline_clients=4, baseline_seconds=2.0, warmup_seconds=1.0, max_tokens=8)

    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-load-"))
    figures: dict = {"model": opts.model, "clients": opts.clients, "seconds": opts.seconds, "max_tokens": opts.max_tokens,
                     "max_pending_requests": opts.max_pending_requests, "baseline_clients": opts.baseline_clients}
    child = rss = None
    try:
        model_dir = prepare_model(opts.model, work)
        child = start_rollout(model_dir, engine_args(opts.model), work / "run", opts.max_pending_requests)
        url = f"http://127.0.0.1:{asyncio.run(http_port_of(child.grpc_address))}"
        rss = RssSampler(child.process.pid)
        figures.update(asyncio.run(bench(url, rss, opts)))
        figures["health_after"] = child.process.poll() is None and asyncio.run(healthy(url))
    finally:
        if rss is not None:
            rss.stop()
        if child is not None:
            child.stop()
        shutil.rmtree(work, ignore_errors=True)
    failed = failures(figures)
    for reason in failed:
        print(f"FAILED: {reason}", file=sys.stderr)
    record("load", figures, args=opts, smoke=opts.smoke)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
