"""Shared fixtures: free ports, and real processes (fast engine fixture, gateway) started and stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
FAST_ENGINE_SCRIPT = REPO_ROOT / "bench" / "fast_engine.py"
DEV_KEY = "sk-adaptergate-dev"


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for the rare server that cannot bind port 0 itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A child process that announced its port through the ready-file contract."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Signal the process and wait for it; SIGKILL (and its group) if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.process.returncode)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def start_server(argv: Sequence[str], workdir: Path, *, timeout_s: float = 60.0, name: str = "server") -> ServerProcess:
    """Run `argv --ready-file PATH` (argv must accept it) and wait until PATH names the port."""
    ready = workdir / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        [*argv, "--ready-file", str(ready)], cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT
    )
    log_file.close()
    give_up = time.monotonic() + timeout_s
    while not ready.exists():
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log_path.read_text(errors='replace')}")
        if time.monotonic() > give_up:
            process.kill()
            raise RuntimeError(f"{name} not ready in {timeout_s}s:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.02)
    port = int(json.loads(ready.read_text())["port"])
    return ServerProcess(process, port, log_path)


def fast_engine_argv(*args: str) -> list[str]:
    return [sys.executable, str(FAST_ENGINE_SCRIPT), "--port", "0", *args]


def gateway_config(**sections: Any) -> dict[str, Any]:
    """A test gateway config: port 0, in-memory registry, text logs, plus the given sections merged in."""
    config: dict[str, Any] = {
        "server": {"port": 0, "drain_timeout_s": 10},
        "registry": {"path": ":memory:", "seed_demo_adapters": False},
        "telemetry": {"log_format": "json", "access_log": True},
        "engines": {"local": {"count": 0}, "poll_interval_s": 0.2, "rpc_timeout_s": 2},
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(name), dict):
            config[name] = {**config[name], **value}
        else:
            config[name] = value
    return config


def start_gateway(config: dict[str, Any], workdir: Path, *, timeout_s: float = 60.0) -> ServerProcess:
    """Start `python -m gateway serve` with `config` written to a YAML file in `workdir`."""
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return start_server(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path)], workdir, timeout_s=timeout_s, name="gateway"
    )


@pytest.fixture
def fast_engine_process(tmp_path: Path) -> Iterator[ServerProcess]:
    """A fast engine fixture process (16 chunks, no delay)."""
    server = start_server(fast_engine_argv(), tmp_path, name="fast-engine")
    yield server
    server.kill()


@pytest.fixture
def process_cleanup() -> Iterator[list[ServerProcess]]:
    """Append processes here to have them killed after the test, whatever happens."""
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.kill()


@pytest.fixture
def dev_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {DEV_KEY}"}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def http_json(method: str, url: str, body: object = None, key: str | None = DEV_KEY, timeout_s: float = 10.0) -> Any:
    """One JSON request with the standard library; returns (status, parsed body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def manifest(name: str, *versions: tuple[str, str, float]) -> dict[str, Any]:
    """An AdapterInstance manifest (as JSON) with (version, source, weight) triples."""
    return {
        "apiVersion": "adapter.ai/v1",
        "kind": "AdapterInstance",
        "metadata": {"name": name},
        "spec": {
            "baseModel": "smollm2-135m-instruct",
            "versions": [{"name": v, "source": src, "weight": w} for v, src, w in versions],
        },
    }


@pytest.fixture(scope="session")
def _span_exporter() -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def spans(_span_exporter: Any) -> Any:
    """Finished OpenTelemetry spans of this test (`spans.get_finished_spans()`), recorded in memory."""
    _span_exporter.clear()
    return _span_exporter
