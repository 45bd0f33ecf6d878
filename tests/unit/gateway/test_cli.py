"""adapterctl against a small recording aiohttp server standing in for the admin API."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from aiohttp import web

from gateway import cli

ADMIN_KEY = "admin-secret"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "adapters"
EXAMPLE_NAMES = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))
MANIFEST = """\
apiVersion: adapter.ai/v1
kind: AdapterInstance
metadata: {name: pirate}
spec:
  baseModel: smollm2-135m-instruct
  versions:
    - {name: v1, source: adapters/pirate-v1, weight: 90}
    - {name: v2, source: /abs/pirate-v2, weight: 10}
    - {name: v3, source: "hf://org/pirate", weight: 0}
---
apiVersion: adapter.ai/v1
kind: AdapterInstance
metadata: {name: shout}
spec:
  baseModel: smollm2-135m-instruct
  allowedTenants: [acme]
  pin: true
  versions:
    - {name: v1, source: ../shout, weight: 1}
"""


@dataclass
class FakeAdmin:
    """Records every request and keeps applied manifests, like the gateway's admin API would."""

    url: str = ""
    requests: list[tuple[str, str, str | None, Any]] = field(default_factory=list)
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)
    residency: dict[str, list[dict[str, str]]] = field(default_factory=dict)


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # urllib honours proxy variables; the fake admin API is on loopback.
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
async def admin() -> AsyncIterator[FakeAdmin]:
    state = FakeAdmin()

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        state.requests.append((request.method, request.path, request.headers.get("Authorization"), body))
        if request.headers.get("Authorization") != f"Bearer {ADMIN_KEY}":
            return _error(401, "invalid admin key", "authentication_error")
        return await handler(request)

    async def apply(request: web.Request) -> web.Response:
        applied = []
        for manifest in (await request.json())["manifests"]:
            name = manifest["metadata"]["name"]
            old = state.adapters.get(name)
            previous = old["metadata"]["generation"] if old else 0
            if old is not None and old["spec"] == manifest["spec"]:
                applied.append({**old, "result": "unchanged"})
                continue
            manifest["metadata"]["generation"] = previous + 1
            state.adapters[name] = manifest
            applied.append({**manifest, "result": "configured" if old else "created"})
        return web.json_response({"applied": applied})

    def with_residency(name: str) -> dict[str, Any]:
        item = dict(state.adapters[name])
        if name in state.residency:
            item["residency"] = state.residency[name]
        return item

    async def list_adapters(request: web.Request) -> web.Response:
        return web.json_response({"adapters": [with_residency(n) for n in sorted(state.adapters)]})

    async def get_adapter(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in state.adapters:
            return _error(404, f"adapter {name!r} not found", "not_found")
        return web.json_response(with_residency(name))

    async def delete_adapter(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if state.adapters.pop(name, None) is None:
            return _error(404, f"adapter {name!r} not found", "not_found")
        return web.json_response({"deleted": name})

    async def queues(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "tenants": {
                    "acme": {
                        "depth": 3,
                        "oldest_wait_s": 1.25,
                        "served_tokens": 4096,
                        "in_flight_requests": 2,
                        "in_flight_tokens": 900,
                        "rejected": 1,
                    },
                    "dev": {
                        "depth": 0,
                        "oldest_wait_s": 0.0,
                        "served_tokens": 12,
                        "in_flight_requests": 0,
                        "in_flight_tokens": 0,
                        "rejected": 0,
                    },
                }
            }
        )

    app = web.Application(middlewares=[record])
    app.router.add_post("/admin/adapters", apply)
    app.router.add_get("/admin/adapters", list_adapters)
    app.router.add_get("/admin/adapters/{name}", get_adapter)
    app.router.add_delete("/admin/adapters/{name}", delete_adapter)
    app.router.add_get("/admin/queues", queues)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    state.url = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


async def _run(admin: FakeAdmin, *args: str) -> int:
    # The CLI blocks on urllib: run it off the loop that serves the fake admin API.
    return await asyncio.to_thread(cli.main, ["--server", admin.url, "--api-key", ADMIN_KEY, *args])


def _manifest_file(tmp_path: Path) -> Path:
    folder = tmp_path / "manifests"
    folder.mkdir()
    path = folder / "adapters.yaml"
    path.write_text(MANIFEST)
    return path


async def test_apply_sends_parsed_manifests_with_resolved_sources(
    admin: FakeAdmin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _manifest_file(tmp_path)
    assert await _run(admin, "apply", "-f", str(path)) == 0
    method, url_path, auth, body = admin.requests[-1]
    assert (method, url_path, auth) == ("POST", "/admin/adapters", f"Bearer {ADMIN_KEY}")
    pirate, shout = body["manifests"]
    assert [v["source"] for v in pirate["spec"]["versions"]] == [
        str(tmp_path / "manifests" / "adapters" / "pirate-v1"),
        "/abs/pirate-v2",
        "hf://org/pirate",
    ]
    assert shout["spec"]["versions"][0]["source"] == str(tmp_path / "shout")
    assert shout["spec"]["allowedTenants"] == ["acme"] and shout["spec"]["pin"] is True
    out = capsys.readouterr().out
    assert "adapter/pirate created (generation 1)" in out
    assert "adapter/shout created (generation 1)" in out


async def test_apply_says_when_nothing_changed_like_kubectl(
    admin: FakeAdmin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _manifest_file(tmp_path)
    assert await _run(admin, "apply", "-f", str(path)) == 0
    capsys.readouterr()
    path.write_text(MANIFEST.replace("pin: true", "pin: false"))
    assert await _run(admin, "apply", "-f", str(path)) == 0
    assert capsys.readouterr().out.splitlines() == [
        "adapter/pirate unchanged (generation 1)",
        "adapter/shout configured (generation 2)",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--timeout", "-1", "get"], "--timeout: must be a positive number of seconds, got '-1'"),
        (["--timeout", "nan", "get"], "--timeout: must be a positive number of seconds, got 'nan'"),
        (["--timeout", "0", "get"], "--timeout: must be a positive number of seconds, got '0'"),
        (["top", "--watch", "nan"], "--watch: must be a positive number of seconds, got 'nan'"),
        (["top", "--watch", "inf"], "--watch: must be a positive number of seconds, got 'inf'"),
        (["top", "--watch", "1", "--count", "0"], "--count: must be a positive integer, got '0'"),
    ],
)
def test_bad_numbers_are_usage_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Once ValueError / OverflowError tracebacks from socket.settimeout and time.sleep.
    with pytest.raises(SystemExit) as exited:
        cli.main(["--server", "http://127.0.0.1:1", *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "server", ["http://[::1", "localhost:8080", "ftp://127.0.0.1/", "http://", "http://127.0.0.1:99999"]
)
def test_malformed_server_url_fails_with_a_message(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--server", server, "get"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --server {server!r}: ")
    assert "Traceback" not in err


async def test_invalid_manifest_fails_before_any_request(
    admin: FakeAdmin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(MANIFEST.replace("weight: 90", "weight: -90"))
    assert await _run(admin, "apply", "-f", str(path)) == 1
    err = capsys.readouterr().err
    assert "document 1: spec.versions[0].weight" in err
    assert admin.requests == []
    assert await _run(admin, "apply", "-f", str(tmp_path / "missing.yaml")) == 1
    assert "missing.yaml" in capsys.readouterr().err
    assert admin.requests == []


async def test_get_outputs(admin: FakeAdmin, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _run(admin, "apply", "-f", str(_manifest_file(tmp_path)))
    capsys.readouterr()
    assert await _run(admin, "get") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "BASE", "MODEL", "VERSIONS", "TENANTS", "PIN", "GENERATION"]
    assert lines[1].split() == ["pirate", "smollm2-135m-instruct", "v1=90", "v2=10", "v3=0", "*", "no", "1"]
    assert lines[2].split() == ["shout", "smollm2-135m-instruct", "v1=1", "acme", "yes", "1"]

    assert await _run(admin, "get", "shout", "-o", "json") == 0
    assert json.loads(capsys.readouterr().out)["metadata"] == {"name": "shout", "generation": 1}
    assert await _run(admin, "get", "-o", "yaml") == 0
    listed = yaml.safe_load(capsys.readouterr().out)
    assert [a["metadata"]["name"] for a in listed["adapters"]] == ["pirate", "shout"]
    assert [r[:2] for r in admin.requests[1:]] == [
        ("GET", "/admin/adapters"),
        ("GET", "/admin/adapters/shout"),
        ("GET", "/admin/adapters"),
    ]


async def test_server_errors_print_message_and_exit_1(admin: FakeAdmin, capsys: pytest.CaptureFixture[str]) -> None:
    assert await _run(admin, "get", "nope") == 1
    assert capsys.readouterr().err.strip() == "error: adapter 'nope' not found"
    assert await _run(admin, "delete", "nope") == 1
    assert "not found" in capsys.readouterr().err
    code = await asyncio.to_thread(cli.main, ["--server", admin.url, "--api-key", "wrong", "get"])
    assert code == 1
    assert capsys.readouterr().err.strip() == "error: invalid admin key"


async def test_env_configures_server_and_key(
    admin: FakeAdmin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ADAPTERGATE_ADMIN_URL", admin.url)
    monkeypatch.setenv("ADAPTERGATE_ADMIN_KEY", ADMIN_KEY)
    assert await asyncio.to_thread(cli.main, ["get"]) == 0
    assert capsys.readouterr().out.strip() == "No adapters."
    assert admin.requests[-1][2] == f"Bearer {ADMIN_KEY}"


async def test_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = await asyncio.to_thread(cli.main, ["--server", f"http://127.0.0.1:{port}", "get"])
    assert code == 1
    assert f"cannot reach http://127.0.0.1:{port}" in capsys.readouterr().err


async def test_describe_and_delete(admin: FakeAdmin, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _run(admin, "apply", "-f", str(_manifest_file(tmp_path)))
    admin.residency["pirate"] = [
        {"engine": "engine-0", "version": "v1", "state": "gpu"},
        {"engine": "engine-1", "version": "v2", "state": "host"},
    ]
    capsys.readouterr()
    assert await _run(admin, "describe", "pirate") == 0
    out = capsys.readouterr().out
    assert "Name:          pirate" in out
    assert "Pinned to:     - (traffic split by weight)" in out
    assert any(line.split()[:3] == ["v1", "90", "90%"] for line in out.splitlines())
    assert any(line.split() == ["engine-1", "v2", "host"] for line in out.splitlines())
    assert await _run(admin, "describe", "shout") == 0
    out = capsys.readouterr().out
    assert "Keep resident: yes" in out and "Tenants:       acme" in out
    assert "(not reported)" in out

    assert await _run(admin, "delete", "shout") == 0
    assert capsys.readouterr().out.strip() == "adapter/shout deleted"
    assert admin.requests[-1][:2] == ("DELETE", "/admin/adapters/shout")
    assert "shout" not in admin.adapters


async def test_top_once_and_watch(admin: FakeAdmin, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _run(admin, "apply", "-f", str(_manifest_file(tmp_path)))
    admin.residency["shout"] = [{"engine": "engine-0", "version": "v1", "state": "gpu"}]
    capsys.readouterr()
    assert await _run(admin, "top") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["acme", "3", "1.25s", "4096", "2", "900", "1"]
    assert lines[2].split() == ["dev", "0", "0.00s", "12", "0", "0", "0"]
    assert ["shout", "engine-0", "v1", "gpu"] in [line.split() for line in lines]

    before = len(admin.requests)
    assert await _run(admin, "top", "--watch", "0.01", "--count", "3") == 0
    assert capsys.readouterr().out.count("\x1b[H\x1b[2J") == 3
    assert [r[1] for r in admin.requests[before:]] == ["/admin/queues", "/admin/adapters"] * 3


async def test_apply_folder_of_example_manifests(admin: FakeAdmin) -> None:
    assert await _run(admin, "apply", "-f", str(EXAMPLES)) == 0
    assert sorted(admin.adapters) == EXAMPLE_NAMES
    demo_adapters = EXAMPLES.parents[1] / "engine" / "demo_adapters"
    sources = {v["source"] for m in admin.adapters.values() for v in m["spec"]["versions"]}
    assert sources == {str(demo_adapters / name) for name in EXAMPLE_NAMES}


async def test_unreadable_manifests_fail_with_a_message(
    admin: FakeAdmin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "adapters.yaml"
    binary.write_bytes(b"\xff\xfe" + MANIFEST.encode("utf-16-le"))
    assert await _run(admin, "apply", "-f", str(binary)) == 1
    assert f"{binary}: not UTF-8 text" in capsys.readouterr().err
    nested = tmp_path / "nested.yaml"
    nested.write_text("spec: " + "[" * 5000 + "]" * 5000)
    assert await _run(admin, "apply", "-f", str(nested)) == 1
    assert f"{nested}: not valid YAML: nested too deeply" in capsys.readouterr().err
    assert admin.requests == []


async def test_server_that_does_not_speak_http(capsys: pytest.CaptureFixture[str]) -> None:
    # The easy mistake: pointing adapterctl at an engine's gRPC port instead of the gateway's.
    engine = grpc.aio.server()
    port = engine.add_insecure_port("127.0.0.1:0")
    await engine.start()
    try:
        code = await asyncio.to_thread(cli.main, ["--server", f"http://127.0.0.1:{port}", "get"])
    finally:
        await engine.stop(None)
    assert code == 1
    assert f"error: http://127.0.0.1:{port} did not answer in HTTP/1.1" in capsys.readouterr().err


async def test_api_key_that_no_header_can_carry(admin: FakeAdmin, capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(cli.main, ["--server", admin.url, "--api-key", "\u201csecret\u201d", "get"])
    assert code == 1
    assert "admin API key" in capsys.readouterr().err
    assert admin.requests == []


async def test_server_that_takes_the_request_but_does_not_answer(capsys: pytest.CaptureFixture[str]) -> None:
    # Connected and sent, then no reply in time: "cannot reach" was wrong, and hid that the apply may still land.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes connections; nothing ever reads or answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        code = await asyncio.to_thread(cli.main, ["--server", url, "--timeout", "0.3", "apply", "-f", str(EXAMPLES)])
    assert code == 1
    err = capsys.readouterr().err
    assert f"error: POST /admin/adapters: {url} did not answer within 0.3 s" in err
    assert "it may still take effect" in err
