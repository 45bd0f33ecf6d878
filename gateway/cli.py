"""`adapterctl`: manage AdapterInstances and watch the queues through the gateway's admin HTTP API.

Blocking stdlib HTTP (urllib) on purpose: a short-lived command has no event loop to share.
Manifests are validated locally before anything is sent, so typos fail fast and offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import math
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gateway.errors import InvalidRequest
from gateway.manifest import AdapterInstance, parse_manifests

DEFAULT_SERVER = "http://127.0.0.1:8080"


class CliError(Exception):
    """A failure to report on stderr before exiting with status 1."""


class AdminClient:
    """Minimal JSON client for the admin API, sending the admin key as a bearer token."""

    def __init__(self, server: str, api_key: str | None, timeout_s: float) -> None:
        self._server = server.rstrip("/")
        self._api_key = api_key
        self._timeout_s = timeout_s

    def call(self, method: str, path: str, body: object | None = None) -> Any:
        """Send one request and return its decoded JSON body; raises `CliError` on any failure."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self._server + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self._api_key:
            if not _latin1(self._api_key):
                # http.client sends header values as Latin-1 and would raise UnicodeEncodeError mid-request.
                raise CliError(
                    "the admin API key (--api-key / ADAPTERGATE_ADMIN_KEY) has characters no HTTP header carries"
                )
            request.add_header("Authorization", f"Bearer {self._api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise CliError(_server_message(exc)) from None
        except TimeoutError:
            # Raised bare only once connected and sent (a connect timeout comes wrapped in URLError): the
            # gateway has the request, so a change may be applied even though no answer came.
            hint = "raise --timeout" if method == "GET" else "it may still take effect: check with `adapterctl get`"
            raise CliError(
                f"{method} {path}: {self._server} did not answer within {self._timeout_s:g} s ({hint})"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"cannot reach {self._server}: {reason}") from None
        except http.client.HTTPException as exc:
            # Something listens there but does not speak HTTP/1.1, e.g. an engine's gRPC port.
            raise CliError(
                f"{self._server} did not answer in HTTP/1.1 ({type(exc).__name__}): is it the gateway?"
            ) from None
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise CliError(f"{method} {path}: the server sent a body that is not JSON") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `adapterctl` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        _check_server(args.server)
        client = AdminClient(args.server, args.api_key, args.timeout)
        args.handler(client, args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adapterctl", description="Manage adapters and watch queues through the gateway admin API."
    )
    parser.add_argument(
        "--server",
        default=os.environ.get("ADAPTERGATE_ADMIN_URL", DEFAULT_SERVER),
        help="admin API base URL (env ADAPTERGATE_ADMIN_URL, default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("ADAPTERGATE_ADMIN_KEY"),
        help="admin API key, sent as a bearer token (env ADAPTERGATE_ADMIN_KEY)",
    )
    parser.add_argument("--timeout", type=_seconds, default=10.0, help="seconds per HTTP call")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    apply = commands.add_parser("apply", help="create or update adapters from manifest files")
    apply.add_argument(
        "-f", "--filename", action="append", required=True, help="YAML file, folder of them, or - for stdin"
    )
    apply.set_defaults(handler=_apply)

    get = commands.add_parser("get", help="list adapters, or show one")
    get.add_argument("name", nargs="?")
    get.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    get.set_defaults(handler=_get)

    describe = commands.add_parser("describe", help="show one adapter in detail, with its residency")
    describe.add_argument("name")
    describe.set_defaults(handler=_describe)

    delete = commands.add_parser("delete", help="delete an adapter")
    delete.add_argument("name")
    delete.set_defaults(handler=_delete)

    top = commands.add_parser("top", help="per-tenant queues and adapter residency")
    top.add_argument("--watch", type=_seconds, metavar="S", help="refresh every S seconds until interrupted")
    top.add_argument("--count", type=_positive_int, metavar="N", help="with --watch: stop after N refreshes")
    top.set_defaults(handler=_top)
    return parser


def _apply(client: AdminClient, args: argparse.Namespace) -> None:
    instances: list[AdapterInstance] = []
    for filename in args.filename:
        if filename != "-" and Path(filename).is_dir():
            for path in sorted(Path(filename).glob("*.y*ml")):
                instances.extend(_load_manifests(str(path)))
        else:
            instances.extend(_load_manifests(filename))
    if not instances:
        raise CliError("no manifests found")
    names = [i.name for i in instances]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise CliError(f"adapter {duplicates[0]!r} is defined more than once")
    reply = client.call("POST", "/admin/adapters", {"manifests": [i.to_dict() for i in instances]})
    applied = reply.get("applied", []) if isinstance(reply, dict) else []
    for item in applied:
        if isinstance(item, dict):
            name = item.get("metadata", {}).get("name") or item.get("name", "?")
            generation = item.get("metadata", {}).get("generation", item.get("generation"))
            suffix = f" (generation {generation})" if generation is not None else ""
            # kubectl's words: created, configured or unchanged (a gateway too old to say gives "applied").
            verb = item.get("result", "applied")
            print(f"adapter/{name} {verb}{suffix}")
        else:
            print(f"adapter/{item} applied")


def _load_manifests(filename: str) -> list[AdapterInstance]:
    try:
        if filename == "-":
            text, folder = sys.stdin.read(), Path.cwd()
        else:
            path = Path(filename)
            text = path.read_text(encoding="utf-8")
            folder = path.resolve().parent
    except OSError as exc:
        raise CliError(f"{filename}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"{filename}: not UTF-8 text (byte {exc.start})") from None
    try:
        instances = parse_manifests(text)
    except InvalidRequest as exc:
        raise CliError(f"{filename}: {exc.message}") from None
    return [_resolve_sources(instance, folder) for instance in instances]


def _resolve_sources(instance: AdapterInstance, folder: Path) -> AdapterInstance:
    """Make relative local sources absolute against the manifest's folder; URIs pass unchanged."""
    versions = tuple(
        v
        if "://" in v.source or Path(v.source).is_absolute()
        else dataclasses.replace(v, source=os.path.normpath(folder / v.source))
        for v in instance.versions
    )
    return dataclasses.replace(instance, versions=versions)


def _get(client: AdminClient, args: argparse.Namespace) -> None:
    if args.name:
        reply = _one_adapter(client, args.name)
        items = [reply]
    else:
        reply = client.call("GET", "/admin/adapters")
        items = _adapters(reply)
    if args.output == "json":
        print(json.dumps(reply, indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump(reply, sort_keys=False), end="")
    elif not items:
        print("No adapters.")
    else:
        rows = [_summary_row(item) for item in items]
        print(_table(("NAME", "BASE MODEL", "VERSIONS", "TENANTS", "PIN", "GENERATION"), rows))


def _describe(client: AdminClient, args: argparse.Namespace) -> None:
    item = _one_adapter(client, args.name)
    meta, spec = item.get("metadata", {}), item.get("spec", {})
    versions = spec.get("versions", [])
    total = sum(float(v.get("weight", 0)) for v in versions) or 1.0
    pinned = spec.get("pinnedVersion")
    lines = [
        f"Name:          {meta.get('name', args.name)}",
        f"Generation:    {meta.get('generation', '-')}",
        f"Base model:    {spec.get('baseModel', '-')}",
        f"Tenants:       {', '.join(spec.get('allowedTenants', [])) or '(none)'}",
        f"Scopes:        {', '.join(spec.get('scopes', [])) or '(none)'}",
        f"Priority:      {spec.get('priority', 0)}",
        f"Keep resident: {'yes' if spec.get('pin') else 'no'}",
        f"Pinned to:     {pinned or '- (traffic split by weight)'}",
        "Versions:",
    ]
    rows = []
    for v in versions:
        share = (1.0 if v.get("name") == pinned else 0.0) if pinned else float(v.get("weight", 0)) / total
        rows.append((v.get("name", "?"), _number(v.get("weight", 0)), f"{share:.0%}", v.get("source", "?")))
    lines.append(_indent(_table(("NAME", "WEIGHT", "SHARE", "SOURCE"), rows)))
    residency = _residency_rows(str(meta.get("name", args.name)), item.get("residency"))
    lines.append("Residency:")
    if residency:
        lines.append(_indent(_table(("ENGINE", "VERSION", "STATE"), [r[1:] for r in residency])))
    else:
        lines.append("  (not reported)" if "residency" not in item else "  (not loaded on any engine)")
    print("\n".join(lines))


def _delete(client: AdminClient, args: argparse.Namespace) -> None:
    client.call("DELETE", f"/admin/adapters/{_quote(args.name)}")
    print(f"adapter/{args.name} deleted")


def _top(client: AdminClient, args: argparse.Namespace) -> None:
    if args.watch is None:
        print(_top_screen(client))
        return
    shown = 0
    while args.count is None or shown < args.count:
        screen = _top_screen(client)
        # Clear and home the cursor so each refresh replaces the last, like top(1).
        print("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S") + f"  every {args.watch:g}s\n" + screen, flush=True)
        shown += 1
        if args.count is None or shown < args.count:
            time.sleep(args.watch)


def _top_screen(client: AdminClient) -> str:
    queues = client.call("GET", "/admin/queues")
    adapters = _adapters(client.call("GET", "/admin/adapters"))
    rows = []
    for name, stats in _tenant_stats(queues):
        rows.append(
            (
                name,
                str(stats.get("depth", 0)),
                f"{float(stats.get('oldest_wait_s', 0.0)):.2f}s",
                str(stats.get("served_tokens", 0)),
                str(stats.get("in_flight_requests", 0)),
                str(stats.get("in_flight_tokens", 0)),
                str(stats.get("rejected", 0)),
            )
        )
    parts = [
        _table(("TENANT", "DEPTH", "OLDEST WAIT", "SERVED TOKENS", "IN FLIGHT", "IN-FLIGHT TOKENS", "REJECTED"), rows)
        if rows
        else "No tenants.",
        "",
    ]
    residency = [r for item in adapters for r in _residency_rows(_name_of(item), item.get("residency"))]
    if residency:
        parts.append(_table(("ADAPTER", "ENGINE", "VERSION", "STATE"), residency))
    else:
        parts.append("No adapter residency reported.")
    return "\n".join(parts)


def _seconds(text: str) -> float:
    # socket.settimeout and time.sleep raise on negative, NaN and infinite values: refuse them as usage errors.
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _check_server(server: str) -> None:
    """Refuse a --server (or ADAPTERGATE_ADMIN_URL) urllib cannot use, before it raises mid-request."""
    problem = None
    try:
        parts = urllib.parse.urlsplit(server)
        _ = parts.port  # raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        problem = str(exc)
    else:
        if parts.scheme not in ("http", "https"):
            problem = "must be an http:// or https:// URL, e.g. http://127.0.0.1:8080"
        elif not parts.hostname:
            problem = "names no host"
    if problem is not None:
        raise CliError(f"--server {server!r}: {problem}")


def _server_message(exc: urllib.error.HTTPError) -> str:
    """The OpenAI-shaped error message from the body, or the bare HTTP status."""
    try:
        body = json.loads(exc.read() or b"{}")
        message = body["error"]["message"]
        if isinstance(message, str) and message:
            return message
    except (ValueError, KeyError, TypeError, OSError):
        pass
    return f"HTTP {exc.code} {exc.reason}"


def _one_adapter(client: AdminClient, name: str) -> dict[str, Any]:
    reply = client.call("GET", f"/admin/adapters/{_quote(name)}")
    if not isinstance(reply, dict):
        raise CliError(f"unexpected reply from /admin/adapters/{name}")
    return reply


def _adapters(reply: object) -> list[dict[str, Any]]:
    items = reply.get("adapters", []) if isinstance(reply, dict) else reply
    if not isinstance(items, list):
        raise CliError("unexpected reply from /admin/adapters")
    return [item for item in items if isinstance(item, dict)]


def _tenant_stats(reply: object) -> list[tuple[str, dict[str, Any]]]:
    tenants = reply.get("tenants", {}) if isinstance(reply, dict) else None
    if isinstance(tenants, dict):
        return sorted((str(name), stats) for name, stats in tenants.items() if isinstance(stats, dict))
    if isinstance(tenants, list):
        return [(str(t.get("name", "?")), t) for t in tenants if isinstance(t, dict)]
    raise CliError("unexpected reply from /admin/queues")


def _residency_rows(adapter: str, residency: object) -> list[tuple[str, str, str, str]]:
    """(adapter, engine, version, state) rows from a list of {engine, version, state} records."""
    rows = []
    if isinstance(residency, list):
        for record in residency:
            if isinstance(record, dict):
                rows.append(
                    (
                        adapter,
                        str(record.get("engine", "?")),
                        str(record.get("version", "?")),
                        str(record.get("state", "?")),
                    )
                )
    return rows


def _summary_row(item: dict[str, Any]) -> tuple[str, ...]:
    spec = item.get("spec", {})
    pinned = spec.get("pinnedVersion")
    versions = " ".join(
        f"{v.get('name')}={_number(v.get('weight', 0))}" + ("*" if v.get("name") == pinned else "")
        for v in spec.get("versions", [])
    )
    return (
        _name_of(item),
        str(spec.get("baseModel", "-")),
        versions or "-",
        ",".join(spec.get("allowedTenants", [])) or "-",
        "yes" if spec.get("pin") else "no",
        str(item.get("metadata", {}).get("generation", "-")),
    )


def _name_of(item: dict[str, Any]) -> str:
    return str(item.get("metadata", {}).get("name", "?"))


def _number(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _latin1(text: str) -> bool:
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (headers, *rows)
    ]
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


if __name__ == "__main__":
    sys.exit(main())
