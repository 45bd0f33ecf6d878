"""A real gateway process over fast engine fixture processes: lifecycle, failures, admin API, metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    DEV_KEY,
    FAST_ENGINE_SCRIPT,
    REPO_ROOT,
    ServerProcess,
    fast_engine_argv,
    gateway_config,
    http_json,
    manifest,
    pid_alive,
    start_gateway,
    start_server,
)


def _chat(
    url: str,
    model: str = "base",
    stream: bool = False,
    headers: dict[str, str] | None = None,
    max_tokens: int | None = None,
) -> tuple[int, str]:
    """POST a chat request; returns (status, raw body)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": max_tokens}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST")
    request.add_header("Authorization", f"Bearer {DEV_KEY}")
    for k, v in (headers or {}).items():
        request.add_header(k, v)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _in_background(fn: Any, *args: Any, **kw: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn(*args, **kw)), daemon=True)
    thread.start()
    return thread, result


def _wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < give_up, "condition not reached in time"
        time.sleep(0.02)


def _local_engine(*args: str) -> dict[str, Any]:
    return {"local": {"count": 1, "command": [sys.executable, str(FAST_ENGINE_SCRIPT), *args]}}


def _in_flight(url: str) -> dict[str, int]:
    _, body = http_json("GET", f"{url}/admin/engines")
    return {name: info["in_flight"] for name, info in body["engines"].items()}


def test_serves_adapters_applied_through_the_admin_api(tmp_path: Path, process_cleanup: list[ServerProcess]) -> None:
    gateway = start_gateway(gateway_config(engines=_local_engine("--chunks", "3")), tmp_path)
    process_cleanup.append(gateway)
    url = gateway.url
    assert http_json("GET", f"{url}/healthz", key=None) == (
        200,
        {"status": "ok", "detail": "1/1 engine replicas healthy"},
    )

    status, reply = http_json("POST", f"{url}/admin/adapters", {"manifests": [manifest("pirate", ("v1", "/a/p1", 1))]})
    assert status == 200 and reply["applied"][0]["metadata"]["generation"] == 1
    _wait_for(lambda: http_json("GET", f"{url}/admin/adapters/pirate")[1]["residency"] != [])
    residency = http_json("GET", f"{url}/admin/adapters/pirate")[1]["residency"]
    assert residency == [{"engine": "engine-0", "version": "v1", "state": "resident"}]

    status, body = _chat(url, "pirate")
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "tok tok tok "
    status, body = _chat(url, "pirate", stream=True)
    assert status == 200 and body.endswith("data: [DONE]\n\n") and body.count("chat.completion.chunk") == 5

    # A new version takes the traffic; the old one is unloaded from the engine once idle.
    new = manifest("pirate", ("v1", "/a/p1", 0), ("v2", "/a/p2", 1))
    assert http_json("POST", f"{url}/admin/adapters", {"manifests": [new]})[0] == 200
    _wait_for(
        lambda: [r["version"] for r in http_json("GET", f"{url}/admin/adapters/pirate")[1]["residency"]] == ["v2"]
    )
    status, body = _chat(url, "pirate")
    assert status == 200

    status, queues = http_json("GET", f"{url}/admin/queues")
    assert status == 200 and queues["tenants"]["default"]["served_tokens"] > 0
    assert http_json("GET", f"{url}/admin/queues", key="not-admin")[0] == 403
    assert http_json("POST", f"{url}/admin/adapters", {"manifests": [{"kind": "x"}]})[0] == 400
    assert http_json("DELETE", f"{url}/admin/adapters/pirate") == (200, {"deleted": "pirate"})
    assert http_json("DELETE", f"{url}/admin/adapters/pirate")[0] == 404
    assert _chat(url, "pirate")[0] == 404

    with urllib.request.urlopen(f"{url}/metrics") as response:
        metrics = response.read().decode()
    assert 'adaptergate_requests_total{protocol="rest",status="ok",tenant="default"} 3.0' in metrics
    assert 'adaptergate_queue_depth{tenant="default"} 0' in metrics
    assert 'adaptergate_engine_healthy{replica="engine-0"} 1' in metrics
    # The replica's polled figures (the fast fixture keeps no adapter cache: its counters stay 0).
    assert 'adaptergate_engine_adapter_slot_misses_total{replica="engine-0"}' in metrics
    assert 'adaptergate_engine_running_requests{replica="engine-0"}' in metrics

    log_lines = [json.loads(line) for line in gateway.log().splitlines() if line.startswith("{")]
    access = [line for line in log_lines if line["logger"] == "adaptergate.access"]
    assert access and {"request_id", "tenant", "status", "latency_ms"} <= set(access[0])
    assert gateway.stop() == 0


def test_sigterm_drains_in_flight_requests_then_stops_the_engine(
    tmp_path: Path, process_cleanup: list[ServerProcess]
) -> None:
    gateway = start_gateway(gateway_config(engines=_local_engine("--chunks", "40", "--delay-ms", "25")), tmp_path)
    process_cleanup.append(gateway)
    _, engines = http_json("GET", f"{gateway.url}/admin/engines")
    engine_port = int(engines["engines"]["engine-0"]["address"].rsplit(":", 1)[1])

    thread, result = _in_background(_chat, gateway.url, stream=True)
    _wait_for(lambda: _in_flight(gateway.url)["engine-0"] == 1)
    gateway.process.send_signal(signal.SIGTERM)
    draining = (503, {"status": "unavailable", "detail": "draining"})
    _wait_for(lambda: http_json("GET", f"{gateway.url}/healthz", key=None) == draining)  # the handler ran
    status, body = _chat(gateway.url, max_tokens=2)
    assert status == 503 and json.loads(body)["error"]["code"] == "draining"
    thread.join(10)
    status, body = result[0]
    assert status == 200 and body.count('"content":"tok "') == 40 and body.endswith("data: [DONE]\n\n")
    assert gateway.process.wait(15) == 0
    # The engine child was stopped too: nothing listens on its port any more.
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", engine_port)) != 0


def test_replica_death_fails_its_requests_and_others_move_on(
    tmp_path: Path, process_cleanup: list[ServerProcess]
) -> None:
    engines = [
        start_server(fast_engine_argv("--chunks", "200", "--delay-ms", "10"), tmp_path, name=f"e{i}") for i in range(2)
    ]
    process_cleanup.extend(engines)
    config = gateway_config(engines={"replicas": [e.address for e in engines], "local": {"count": 0}})
    gateway = start_gateway(config, tmp_path)
    process_cleanup.append(gateway)

    first_chunk = threading.Event()
    lines: list[bytes] = []

    def stream() -> None:
        body = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        request = urllib.request.Request(f"{gateway.url}/v1/chat/completions", data=json.dumps(body).encode())
        request.add_header("Authorization", f"Bearer {DEV_KEY}")
        with urllib.request.urlopen(request, timeout=30) as response:
            for line in response:
                lines.append(line)
                if b'"content":"tok "' in line:
                    first_chunk.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert first_chunk.wait(10)
    victim = next(i for i, n in enumerate(_in_flight(gateway.url).values()) if n == 1)
    killed_at = time.monotonic()
    engines[victim].kill()
    thread.join(10)
    assert time.monotonic() - killed_at < 3.0
    text = b"".join(lines).decode()
    # The stream had started (200 sent): the failure arrives as an SSE error chunk.
    assert '"type": "service_unavailable"' in text and text.endswith("data: [DONE]\n\n")

    for _ in range(3):
        status, body = _chat(gateway.url, max_tokens=2)
        assert status == 200, body
    assert not pid_alive(engines[victim].pid)
    assert gateway.stop() == 0


def test_deadline_in_the_queue_is_a_504(tmp_path: Path, process_cleanup: list[ServerProcess]) -> None:
    # The request holding the only slot streams for 3 s (300 x 10 ms), far past the 0.2 s deadline.
    config = gateway_config(engines={**_local_engine("--chunks", "300", "--delay-ms", "10"), "max_concurrency": 1})
    gateway = start_gateway(config, tmp_path)
    process_cleanup.append(gateway)
    thread, result = _in_background(_chat, gateway.url)
    _wait_for(lambda: _in_flight(gateway.url)["engine-0"] == 1)
    status, body = _chat(gateway.url, headers={"X-Request-Timeout": "0.2"}, max_tokens=2)
    assert status == 504 and json.loads(body)["error"]["type"] == "timeout_error"
    # The 504 came while the slot was still taken: from the queue, not from an engine call made too late.
    assert thread.is_alive()
    thread.join(10)
    assert result and result[0][0] == 200
    assert gateway.stop() == 0


def test_adapterctl_drives_the_real_admin_api(
    tmp_path: Path, process_cleanup: list[ServerProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    """adapterctl against a real gateway (its unit tests use a recording stand-in for the admin API): the replies
    it reads and the errors it prints are the real API's, residency on a real engine included."""
    from gateway import cli

    gateway = start_gateway(gateway_config(engines=_local_engine("--chunks", "2")), tmp_path)
    process_cleanup.append(gateway)
    examples = REPO_ROOT / "examples" / "adapters"
    names = sorted(p.stem for p in examples.glob("*.yaml"))
    assert names

    def adapterctl(*args: str, key: str = DEV_KEY) -> tuple[int, str, str]:
        code = cli.main(["--server", gateway.url, "--api-key", key, *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = adapterctl("apply", "-f", str(examples))
    assert code == 0 and all(f"adapter/{name} created (generation 1)" in out for name in names), out
    code, out, _ = adapterctl("get")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == names, out

    def pirate_resident() -> bool:  # as `describe` shows the engine's report (loads are asynchronous)
        code, out, _ = adapterctl("describe", "pirate")
        return code == 0 and ["engine-0", "v1", "resident"] in [line.split() for line in out.splitlines()]

    _wait_for(pirate_resident)
    code, out, _ = adapterctl("delete", "pirate")
    assert (code, out.strip()) == (0, "adapter/pirate deleted")
    code, _, err = adapterctl("get", "pirate")
    assert (code, err.strip()) == (1, "error: adapter 'pirate' not found")
    code, _, err = adapterctl("get", key="not-an-admin-key")
    assert code == 1 and "not an admin key" in err, err
    assert gateway.stop() == 0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ADAPTERGATE__SERVER__PORT": "http"}, "server.port: expected an integer"),
        ({"ADAPTERGATE__QUEUE__DEPTH": "3"}, "queue.depth: unknown key"),
    ],
)
def test_bad_configuration_exits_2_naming_the_key(env: dict[str, str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def test_a_crashed_local_engine_is_restarted(tmp_path: Path, process_cleanup: list[ServerProcess]) -> None:
    gateway = start_gateway(gateway_config(engines=_local_engine("--chunks", "2")), tmp_path)
    process_cleanup.append(gateway)
    assert _chat(gateway.url)[0] == 200
    (engine_pid,) = _children(gateway.pid)
    old_address = http_json("GET", f"{gateway.url}/admin/engines")[1]["engines"]["engine-0"]["address"]
    os.kill(engine_pid, signal.SIGKILL)
    _wait_for(lambda: http_json("GET", f"{gateway.url}/healthz", key=None)[0] == 503, timeout_s=5)
    status, body = _chat(gateway.url)
    assert status == 503 and "no engine replica is available" in body
    _wait_for(lambda: http_json("GET", f"{gateway.url}/healthz", key=None)[0] == 200, timeout_s=20)
    assert _chat(gateway.url)[0] == 200
    engines = http_json("GET", f"{gateway.url}/admin/engines")[1]["engines"]
    assert engines["engine-0"]["address"] != old_address and engine_pid not in _children(gateway.pid)
    assert gateway.stop() == 0
