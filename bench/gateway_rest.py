"""Gateway overhead over REST: the same requests through the gateway and straight to the engine, one run.

Both paths hit one FastEngineFixture process (a deterministic engine with no model), so the difference
is what the gateway adds: HTTP parsing, auth, policy, the fair queue, the engine gRPC hop, and JSON/SSE
encoding. Server, engine and load generator are pinned to CPUs (printed); CPU time per request is read
from /proc/PID/stat. Closed-loop runs at fixed concurrency, then an open-loop run at a fixed arrival
rate of half the measured capacity. Figures are printed last.

    python bench/gateway_rest.py [--duration 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.percentiles import percentile  # noqa: E402  (fairness_live imports it from here)
from engine import engine_pb2 as pb  # noqa: E402
from engine import engine_pb2_grpc as pb_grpc  # noqa: E402

KEY = "sk-adaptergate-dev"
STREAM_CHUNKS = 16
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """One measured run: per-request latencies (and time to first chunk when streaming)."""

    label: str
    latencies: list[float] = field(default_factory=list)
    first_chunk: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def pct(self, q: float, values: list[float] | None = None) -> float:
        return percentile(self.latencies if values is None else values, q)

    def line(self) -> str:
        out = (
            f"{self.label:<34} {self.rate:8.0f} req/s  p50 {self.pct(0.5) * 1e3:7.3f} ms  "
            f"p90 {self.pct(0.9) * 1e3:7.3f}  p99 {self.pct(0.99) * 1e3:7.3f}"
        )
        if self.first_chunk:
            ttfc50, ttfc99 = self.pct(0.5, self.first_chunk), self.pct(0.99, self.first_chunk)
            out += f"  ttfc p50 {ttfc50 * 1e3:6.3f} p99 {ttfc99 * 1e3:6.3f}"
        out += "  cpu/req " + " ".join(f"{k} {v * 1e6:.0f}us" for k, v in self.cpu.items())
        if self.errors:
            out += f"  ERRORS {self.errors}"
        return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start(argv: list[str], ready: Path, cpus: set[int], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    ready.unlink(missing_ok=True)
    process = subprocess.Popen(
        [*argv, "--ready-file", str(ready)],
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    give_up = time.monotonic() + 60
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > give_up:
            process.kill()
            raise RuntimeError(f"{argv[:3]} did not start:\n{log.read_text()}")
        time.sleep(0.02)
    return process, int(json.loads(ready.read_text())["port"])


# -- one request per path ----------------------------------------------------------------------------


def gateway_call(session: aiohttp.ClientSession, url: str, stream: bool) -> Callable[[Run], Awaitable[None]]:
    body = json.dumps(
        {"model": "base", "prompt": "hello", "max_tokens": STREAM_CHUNKS if stream else 1, "stream": stream}
    ).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    async def call(run: Run) -> None:
        t0 = time.perf_counter()
        first = 0.0
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                await response.read()
                run.errors += 1
                return
            if not stream:
                await response.read()
            else:
                async for line in response.content:
                    if line.startswith(b"data: {") and not first:
                        first = time.perf_counter()
                    elif line.startswith(b"data: [DONE]"):
                        break
        done = time.perf_counter()
        run.latencies.append(done - t0)
        if stream:
            run.first_chunk.append(first - t0)

    return call


def direct_call(stub: pb_grpc.EngineStub, stream: bool) -> Callable[[Run], Awaitable[None]]:
    counter = iter(range(1 << 62))
    sampling = pb.SamplingParams(max_tokens=STREAM_CHUNKS if stream else 1)

    async def call(run: Run) -> None:
        request = pb.GenerateRequest(request_id=f"d{next(counter)}", prompt="hello", sampling=sampling)
        t0 = time.perf_counter()
        first = 0.0
        try:
            async for message in stub.Generate(request):
                if message.text and not first:
                    first = time.perf_counter()
        except grpc.aio.AioRpcError:
            run.errors += 1
            return
        done = time.perf_counter()
        run.latencies.append(done - t0)
        if stream:
            run.first_chunk.append(first - t0)

    return call


# -- load shapes -------------------------------------------------------------------------------------


async def closed_loop(
    call: Callable[[Run], Awaitable[None]],
    label: str,
    concurrency: int,
    seconds: float,
    max_requests: int,
    pids: dict[str, int],
) -> Run:
    warm = Run("warm-up")
    await asyncio.gather(*(call(warm) for _ in range(min(4 * concurrency, 200))))
    run = Run(label)
    stop_at = time.perf_counter() + seconds
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.perf_counter()

    async def worker() -> None:
        while time.perf_counter() < stop_at and len(run.latencies) + run.errors < max_requests:
            await call(run)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.seconds = time.perf_counter() - started
    n = max(1, len(run.latencies))
    run.cpu = {name: (cpu_seconds(pid) - cpu0[name]) / n for name, pid in pids.items()}
    return run


async def open_loop(
    call: Callable[[Run], Awaitable[None]], label: str, rate: float, seconds: float, pids: dict[str, int]
) -> Run:
    """Requests sent on a fixed schedule regardless of replies; latency counts from the scheduled time."""
    run = Run(label)
    total = max(1, int(rate * seconds))
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    loop = asyncio.get_running_loop()
    start_at = loop.time() + 0.05
    tasks = []

    async def one(at: float) -> None:
        scheduled = time.perf_counter() + (at - loop.time())
        shadow = Run("")
        await call(shadow)
        if shadow.latencies:
            run.latencies.append(time.perf_counter() - scheduled)
            run.first_chunk += shadow.first_chunk
        run.errors += shadow.errors

    for i in range(total):
        at = start_at + i / rate
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(at)))
    await asyncio.gather(*tasks)
    run.seconds = seconds
    n = max(1, len(run.latencies))
    run.cpu = {name: (cpu_seconds(pid) - cpu0[name]) / n for name, pid in pids.items()}
    return run


async def measure(args: argparse.Namespace, gateway_url: str, engine_address: str, pids: dict[str, int]) -> None:
    runs: dict[tuple[str, str, int], Run] = {}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        channel = grpc.aio.insecure_channel(engine_address)
        stub = pb_grpc.EngineStub(channel)
        for stream in (False, True):
            mode = "stream16" if stream else "plain"
            for concurrency in args.concurrency:
                for path, call in (
                    ("direct", direct_call(stub, stream)),
                    ("gateway", gateway_call(session, f"{gateway_url}/v1/completions", stream)),
                ):
                    label = f"{mode:<8} {path:<7} c={concurrency}"
                    run = await closed_loop(call, label, concurrency, args.duration, args.max_requests, pids)
                    runs[(mode, path, concurrency)] = run
                    print(run.line(), flush=True)
        capacity = max(runs[("plain", "gateway", c)].rate for c in args.concurrency)
        rate = capacity / 2
        for path, call in (
            ("direct", direct_call(stub, False)),
            ("gateway", gateway_call(session, f"{gateway_url}/v1/completions", False)),
        ):
            run = await open_loop(call, f"plain    {path:<7} @{rate:.0f}/s", rate, args.duration, pids)
            runs[("open", path, 0)] = run
            print(run.line(), flush=True)
        await channel.close()
    report(runs, args, rate)


def report(runs: dict[tuple[str, str, int], Run], args: argparse.Namespace, rate: float) -> None:
    c1 = min(args.concurrency)
    print("\n== figures (gateway vs direct engine gRPC, same fast engine, same run) ==")
    for mode in ("plain", "stream16"):
        d, g = runs[(mode, "direct", c1)], runs[(mode, "gateway", c1)]
        added50 = (g.pct(0.5) - d.pct(0.5)) * 1e3
        added99 = (g.pct(0.99) - d.pct(0.99)) * 1e3
        print(f"{mode:<8} added latency at c={c1}: p50 {added50:+.3f} ms  p99 {added99:+.3f} ms")
        if mode == "stream16":
            ttfc = (g.pct(0.5, g.first_chunk) - d.pct(0.5, d.first_chunk)) * 1e3
            print(f"{mode:<8} added time to first chunk at c={c1}: p50 {ttfc:+.3f} ms")
    for mode in ("plain", "stream16"):
        for c in args.concurrency:
            d, g = runs[(mode, "direct", c)], runs[(mode, "gateway", c)]
            print(
                f"{mode:<8} c={c:<3} gateway {g.rate:7.0f} req/s vs direct {d.rate:7.0f} req/s "
                f"(ratio {g.rate / d.rate:.2f}); gateway cpu/req {g.cpu.get('gateway', 0) * 1e6:.0f} us"
            )
    d, g = runs[("open", "direct", 0)], runs[("open", "gateway", 0)]
    print(
        f"open loop @{rate:.0f} req/s (half the gateway's capacity): gateway p50 {g.pct(0.5) * 1e3:.3f} ms "
        f"p99 {g.pct(0.99) * 1e3:.3f} ms vs direct p50 {d.pct(0.5) * 1e3:.3f} ms p99 {d.pct(0.99) * 1e3:.3f} ms"
    )
    best_plain = max(runs[("plain", "gateway", c)].rate for c in args.concurrency)
    best_stream = max(runs[("stream16", "gateway", c)].rate for c in args.concurrency)
    p50_added = (runs[("plain", "gateway", c1)].pct(0.5) - runs[("plain", "direct", c1)].pct(0.5)) * 1e3
    print(
        f"goals: added p50 {p50_added:.3f} ms (<= 1 ms: {'met' if p50_added <= 1 else 'NOT met'}), "
        f"{best_plain:.0f} req/s non-streaming (>= 1000: {'met' if best_plain >= 1000 else 'NOT met'}), "
        f"{best_stream:.0f} streamed req/s (>= 400: {'met' if best_stream >= 400 else 'NOT met'})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measured run")
    parser.add_argument("--max-requests", type=int, default=50_000, help="cap per measured run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--quick", action="store_true", help="1 s runs")
    args = parser.parse_args()
    if args.quick:
        args.duration = 1.0
    cpus = sorted(os.sched_getaffinity(0))
    gateway_cpu = {cpus[0]}
    engine_cpu = {cpus[1 % len(cpus)]}
    client_cpu = {cpus[2 % len(cpus)]} if len(cpus) > 2 else engine_cpu
    os.sched_setaffinity(0, client_cpu)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        work = Path(tmp)
        engine, engine_port = start(
            [sys.executable, str(ROOT / "bench" / "fast_engine.py"), "--port", "0", "--chunks", str(STREAM_CHUNKS)],
            work / "engine.json",
            engine_cpu,
            work / "engine.log",
        )
        config = {
            "server": {"port": 0},
            "engines": {"local": {"count": 0}, "replicas": [f"127.0.0.1:{engine_port}"], "max_concurrency": 256},
            "registry": {"path": ":memory:", "seed_demo_adapters": False},
            "queue": {"max_total_depth": 4096},
            "tenants": [
                {
                    "name": "default",
                    "plain_api_keys": [KEY],
                    "limits": {"max_queue_depth": 4096, "max_tokens_in_flight": 1_000_000},
                }
            ],
            "telemetry": {"log_level": "warning", "access_log": False},
        }
        (work / "gateway.yaml").write_text(yaml.safe_dump(config))
        gateway, gateway_port = start(
            [sys.executable, "-m", "gateway", "serve", "--config", str(work / "gateway.yaml")],
            work / "gateway.json",
            gateway_cpu,
            work / "gateway.log",
        )
        print(f"cpus: gateway {sorted(gateway_cpu)}  engine {sorted(engine_cpu)}  load generator {sorted(client_cpu)}")
        print(f"python {sys.version.split()[0]}  aiohttp {aiohttp.__version__}  grpcio {grpc.__version__}")
        print("gateway config: tracing sdk (no exporter), access log off, log level warning, policy static")
        try:
            asyncio.run(
                measure(
                    args,
                    f"http://127.0.0.1:{gateway_port}",
                    f"127.0.0.1:{engine_port}",
                    {"gateway": gateway.pid, "engine": engine.pid},
                )
            )
        finally:
            for process in (gateway, engine):
                process.terminate()
                process.wait(15)


if __name__ == "__main__":
    main()
