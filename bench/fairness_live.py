"""Live fairness: two tenants through the real gateway vs straight to the engine, side by side, one run.

The live counterpart of `bench/fairness.py` (which runs `FairQueue` alone in virtual time). One engine
process serves both paths: the deterministic fast engine fixture with a fixed number of generation slots
and a FIFO wait for them, as an engine scheduler with `max_num_seqs` has. Each request yields `--chunks`
tokens `--delay-ms` apart, so the engine (slots / (chunks * delay) requests per second) is the bottleneck.

Tenants "heavy" and "light" offer 10:1 load, closed loop and non-streaming: 40 vs 4 concurrent clients,
each sending its next request as soon as the last one completes, so both stay backlogged far above their
share. Served tokens are the completion tokens of the responses' usage, counted in the 10 s window in
which each request completed, after an uncounted warm-up.

  direct    the clients call the engine's gRPC Generate themselves: the engine's FIFO decides (baseline)
  gateway   `python -m gateway serve` in front of the same engine (engines.max_concurrency = the slots,
            so nothing waits in the engine), restarted for weights heavy:light 1:1 and 3:1

The direct run does not depend on weights; it is compared with each scenario's target. Gateway, engine
and load generator are pinned to CPUs (printed). The figures come last.

    python bench/fairness_live.py [--seconds 40] [--warmup 3] [--chunks 16] [--delay-ms 1.25] [--slots 4]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Sibling scripts by their own names (bench/ is this script's sys.path entry, not a package), as mypy sees them.
from fast_engine import FastEngineFixture, FastEngineOptions, write_ready_file  # noqa: E402
from gateway_rest import cpu_seconds, percentile, start  # noqa: E402

from engine import engine_pb2 as pb  # noqa: E402
from engine import engine_pb2_grpc as pb_grpc  # noqa: E402

TENANTS = ("heavy", "light")
KEYS = {"heavy": "sk-bench-heavy", "light": "sk-bench-light"}
PROMPT = "hello"
MAX_REQUESTS = 200_000  # a bound on every run besides its duration


# -- the engine: the fixture behind a FIFO of generation slots ------------------------------------------


class FifoSlots:
    """An async context manager admitting `slots` holders at a time, strictly first come first served.

    A released slot passes straight to the oldest waiter, so a newcomer can never overtake it.
    """

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def __aenter__(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the slot was handed over just as the caller went away
            else:
                self._waiters.remove(waiter)
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1


class SlottedEngine(FastEngineFixture):
    """The fast engine fixture generating for at most `slots` requests at once; the rest wait in FIFO order."""

    def __init__(self, options: FastEngineOptions, slots: int) -> None:
        super().__init__(options)
        self._slots = FifoSlots(slots)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async with self._slots:
            async for message in super().Generate(request, context):
                yield message


async def serve_engine(args: argparse.Namespace) -> None:
    engine = SlottedEngine(FastEngineOptions(chunks=args.chunks, delay_s=args.delay_ms / 1000), args.slots)
    port = await engine.start("127.0.0.1", 0)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    write_ready_file(args.ready_file, port)
    await stop.wait()
    await engine.stop()


# -- load: closed loop per tenant, completions stamped with time and tokens --------------------------------


class RequestFailed(Exception):
    """A reply that was not a successful completion."""


Call = Callable[[str], Awaitable[int]]  # tenant -> completion tokens served


@dataclass(frozen=True, slots=True)
class Completion:
    at_s: float  # completion time, seconds after the warm-up ended
    tokens: int
    latency_s: float


@dataclass(slots=True)
class RunLog:
    label: str
    done: dict[str, list[Completion]] = field(default_factory=lambda: {t: [] for t in TENANTS})
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0))
    cpu_per_request_s: dict[str, float] = field(default_factory=dict)


def gateway_call(session: aiohttp.ClientSession, base_url: str, max_tokens: int) -> Call:
    body = json.dumps({"model": "base", "prompt": PROMPT, "max_tokens": max_tokens, "stream": False}).encode()
    headers = {t: {"Authorization": f"Bearer {KEYS[t]}", "Content-Type": "application/json"} for t in TENANTS}

    async def call(tenant: str) -> int:
        async with session.post(f"{base_url}/v1/completions", data=body, headers=headers[tenant]) as response:
            payload = await response.read()
            if response.status != 200:
                raise RequestFailed(f"HTTP {response.status}: {payload[:200]!r}")
        return int(json.loads(payload)["usage"]["completion_tokens"])

    return call


def direct_call(stub: pb_grpc.EngineStub, max_tokens: int) -> Call:
    ids = itertools.count()
    sampling = pb.SamplingParams(max_tokens=max_tokens)

    async def call(tenant: str) -> int:
        request = pb.GenerateRequest(request_id=f"{tenant}-{next(ids)}", prompt=PROMPT, sampling=sampling)
        tokens = 0
        async for message in stub.Generate(request):
            if message.HasField("usage"):
                tokens = message.usage.completion_tokens
        return tokens

    return call


async def closed_loop(
    call: Call, label: str, streams: dict[str, int], warmup_s: float, seconds: float, pids: dict[str, int]
) -> RunLog:
    """`streams[t]` clients per tenant, each sending its next request when the last one completes."""
    log = RunLog(label)
    issued = itertools.count()
    origin = time.perf_counter() + warmup_s
    stop_at = origin + seconds
    cpu0: dict[str, float] = {}
    counted0 = 0

    async def client(tenant: str) -> None:
        while (sent := time.perf_counter()) < stop_at and next(issued) < MAX_REQUESTS:
            try:
                tokens = await asyncio.wait_for(call(tenant), timeout=30)
            except (aiohttp.ClientError, grpc.aio.AioRpcError, RequestFailed, TimeoutError) as exc:
                if log.errors[tenant] == 0:
                    print(f"  {label}: first {tenant} error: {exc!r}"[:300], flush=True)
                log.errors[tenant] += 1
                await asyncio.sleep(0.01)  # do not spin on a failing server
                continue
            done = time.perf_counter()
            log.done[tenant].append(Completion(done - origin, tokens, done - sent))

    async def snapshot_after_warmup() -> None:
        nonlocal cpu0, counted0
        await asyncio.sleep(warmup_s)
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        counted0 = sum(len(v) for v in log.done.values())

    await asyncio.gather(snapshot_after_warmup(), *(client(t) for t in TENANTS for _ in range(streams[t])))
    served = max(1, sum(len(v) for v in log.done.values()) - counted0)
    log.cpu_per_request_s = {name: (cpu_seconds(pid) - cpu0[name]) / served for name, pid in pids.items()}
    return log


# -- summaries ---------------------------------------------------------------------------------------------


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all values are equal, 1/n when one takes everything."""
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 1.0


@dataclass(frozen=True, slots=True)
class Summary:
    """One run judged against one set of weights."""

    windows: list[dict[str, int]]
    ratios: list[float]
    jains: list[float]
    target: float
    light_p50_s: float
    light_p99_s: float
    requests_per_s: float

    @property
    def mean_ratio(self) -> float:
        return statistics.fmean(self.ratios)

    @property
    def error(self) -> float:
        """Mean relative distance of the per-window ratio from the weight ratio."""
        return statistics.fmean(abs(r / self.target - 1) for r in self.ratios)

    @property
    def jain_mean(self) -> float:
        return statistics.fmean(self.jains)


def summarize(log: RunLog, weights: dict[str, float], seconds: float, window_s: float) -> Summary:
    count = max(1, int(seconds // window_s))
    windows = [dict.fromkeys(TENANTS, 0) for _ in range(count)]
    for tenant in TENANTS:
        for c in log.done[tenant]:
            if 0 <= c.at_s < count * window_s:
                windows[int(c.at_s // window_s)][tenant] += c.tokens
    light = [c.latency_s for c in log.done["light"] if 0 <= c.at_s < seconds]
    measured = sum(1 for t in TENANTS for c in log.done[t] if 0 <= c.at_s < seconds)
    return Summary(
        windows=windows,
        ratios=[w["heavy"] / max(w["light"], 1) for w in windows],
        jains=[jain([w[t] / weights[t] for t in TENANTS]) for w in windows],
        target=weights["heavy"] / weights["light"],
        light_p50_s=percentile(light, 0.5),
        light_p99_s=percentile(light, 0.99),
        requests_per_s=measured / seconds,
    )


def describe(name: str, s: Summary, log: RunLog) -> str:
    cpu = " ".join(f"{k} {v * 1e6:.0f}us" for k, v in log.cpu_per_request_s.items())
    return (
        f"  {name:<8} mean ratio {s.mean_ratio:6.2f}  error vs weights {s.error:6.1%}  "
        f"Jain mean {s.jain_mean:.3f} min {min(s.jains):.3f}  light p50 {s.light_p50_s * 1e3:6.1f} ms "
        f"p99 {s.light_p99_s * 1e3:6.1f} ms  {s.requests_per_s:5.0f} req/s  cpu/req {cpu}  errors {log.errors}"
    )


# -- the run -----------------------------------------------------------------------------------------------


def gateway_config(engine_port: int, slots: int, weights: dict[str, float]) -> dict[str, object]:
    return {
        "server": {"port": 0},
        "engines": {"local": {"count": 0}, "replicas": [f"127.0.0.1:{engine_port}"], "max_concurrency": slots},
        "registry": {"path": ":memory:", "seed_demo_adapters": False},
        "queue": {"max_total_depth": 4096, "max_total_tokens_in_flight": 10_000_000},
        "tenants": [
            {
                "name": t,
                "plain_api_keys": [KEYS[t]],
                "weight": weights[t],
                # High enough that neither tenant is ever throttled: the pick alone decides.
                "limits": {"max_queue_depth": 1024, "max_tokens_in_flight": 1_000_000},
            }
            for t in TENANTS
        ],
        "telemetry": {"log_level": "warning", "access_log": False},
    }


async def run_all(
    args: argparse.Namespace, work: Path, engine_port: int, engine_pid: int, cpus: dict[str, set[int]]
) -> None:
    streams = {"heavy": args.heavy_streams, "light": args.light_streams}
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine_port}")
    direct = await closed_loop(
        direct_call(pb_grpc.EngineStub(channel), args.chunks),
        "direct",
        streams,
        args.warmup,
        args.seconds,
        {"engine": engine_pid},
    )
    await channel.close()
    print(f"direct run done: {sum(len(v) for v in direct.done.values())} requests", flush=True)
    scenarios: list[tuple[dict[str, float], RunLog]] = []
    for heavy_weight in (1.0, 3.0):
        weights = {"heavy": heavy_weight, "light": 1.0}
        (work / "gateway.yaml").write_text(yaml.safe_dump(gateway_config(engine_port, args.slots, weights)))
        gateway, gateway_port = start(
            [sys.executable, "-m", "gateway", "serve", "--config", str(work / "gateway.yaml")],
            work / "gateway.json",
            cpus["gateway"],
            work / "gateway.log",
        )
        try:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                log = await closed_loop(
                    gateway_call(session, f"http://127.0.0.1:{gateway_port}", args.chunks),
                    f"gateway {heavy_weight:g}:1",
                    streams,
                    args.warmup,
                    args.seconds,
                    {"gateway": gateway.pid, "engine": engine_pid},
                )
        finally:
            gateway.terminate()
            gateway.wait(15)
        print(f"gateway {heavy_weight:g}:1 run done: {sum(len(v) for v in log.done.values())} requests", flush=True)
        scenarios.append((weights, log))
    report(args, direct, scenarios)


def report(args: argparse.Namespace, direct: RunLog, scenarios: list[tuple[dict[str, float], RunLog]]) -> None:
    figures: list[str] = []
    for weights, log in scenarios:
        ours = summarize(log, weights, args.seconds, args.window)
        fifo = summarize(direct, weights, args.seconds, args.window)
        print(f"\nweights heavy:light = {ours.target:g}:1 — served completion tokens heavy:light per window")
        print(f"window     {'gateway':>10} {'direct':>10} {'target':>8}   tokens gateway (h/l)   tokens direct (h/l)")
        for i, (g, d) in enumerate(zip(ours.windows, fifo.windows, strict=True)):
            start_s = args.warmup + i * args.window
            print(
                f"{start_s:4.0f}-{start_s + args.window:<4.0f} {ours.ratios[i]:10.2f} {fifo.ratios[i]:10.2f} "
                f"{ours.target:8.2f}   {g['heavy']:>8}/{g['light']:<8}     {d['heavy']:>8}/{d['light']:<8}"
            )
        print(describe("gateway", ours, log))
        print(describe("direct", fifo, direct))
        figures.append(
            f"weights {ours.target:g}:1  heavy:light ours {ours.mean_ratio:.2f} / direct FIFO {fifo.mean_ratio:.2f} "
            f"(target {ours.target:.2f}); error vs weights ours {ours.error:.1%} / direct {fifo.error:.1%}; "
            f"Jain ours {ours.jain_mean:.3f} / direct {fifo.jain_mean:.3f} = {ours.jain_mean / fifo.jain_mean:.2f}x; "
            f"light p50 ours {ours.light_p50_s * 1e3:.1f} ms / direct {fifo.light_p50_s * 1e3:.1f} ms "
            f"= {ours.light_p50_s / fifo.light_p50_s:.2f}x, p99 {ours.light_p99_s * 1e3:.1f} / "
            f"{fifo.light_p99_s * 1e3:.1f} ms = {ours.light_p99_s / fifo.light_p99_s:.2f}x; "
            f"throughput ours/direct {ours.requests_per_s / fifo.requests_per_s:.2f}"
        )
    print("\nFigures (real gateway vs the same engine called directly, same load, one run):")
    for line in figures:
        print("  " + line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="uncounted seconds before each measured run")
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--chunks", type=int, default=16, help="completion tokens per request")
    parser.add_argument("--delay-ms", type=float, default=1.25, help="engine time per token")
    parser.add_argument("--slots", type=int, default=4, help="engine slots = gateway engines.max_concurrency")
    parser.add_argument("--heavy-streams", type=int, default=40)
    parser.add_argument("--light-streams", type=int, default=4)
    parser.add_argument("--serve-engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine:
        asyncio.run(serve_engine(args))
        return
    available = sorted(os.sched_getaffinity(0))
    cpus = {
        "gateway": {available[0]},
        "engine": {available[1 % len(available)]},
        "load": {available[2 % len(available)]} if len(available) > 2 else {available[1 % len(available)]},
    }
    os.sched_setaffinity(0, cpus["load"])
    capacity = args.slots / (args.chunks * args.delay_ms / 1000)
    print(
        f"engine: fast engine fixture, {args.slots} FIFO slots, {args.chunks} tokens/request, "
        f"{args.delay_ms:g} ms/token (nominal capacity {capacity:.0f} req/s); load heavy:light = "
        f"{args.heavy_streams}:{args.light_streams} closed-loop non-streaming clients; "
        f"{args.warmup:g} s warm-up + {args.seconds:g} s measured per run"
    )
    print(" ".join(f"{name} cpus {sorted(c)}" for name, c in cpus.items()))
    print(f"python {sys.version.split()[0]}  aiohttp {aiohttp.__version__}  grpcio {grpc.__version__}")
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        work = Path(tmp)
        engine_argv = [sys.executable, str(Path(__file__).resolve()), "--serve-engine"]
        engine_argv += ["--chunks", str(args.chunks), "--delay-ms", str(args.delay_ms), "--slots", str(args.slots)]
        engine, engine_port = start(engine_argv, work / "engine.json", cpus["engine"], work / "engine.log")
        try:
            asyncio.run(run_all(args, work, engine_port, engine.pid, cpus))
        finally:
            engine.terminate()
            engine.wait(15)


if __name__ == "__main__":
    main()
