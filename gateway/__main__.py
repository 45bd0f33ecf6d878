"""`adaptergate`: the composition root.

    adaptergate serve  [--config FILE] [--ready-file PATH]   run the gateway (and its local engines)
    adaptergate engine ARGS...                              run one engine process (python -m engine)
    adaptergate config [--config FILE]                      print the effective configuration

Only here are concrete protocols and policies chosen by name and wired into the core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from collections.abc import Callable, Sequence

from aiohttp import web

from gateway.admin import AdminApi
from gateway.api import PolicyChecker, ProtocolServer
from gateway.config import DEV_API_KEY, Config, ConfigError, dump_yaml, load_config
from gateway.core import Gateway
from gateway.errors import GatewayError
from gateway.telemetry import setup_logging, setup_tracing
from gateway.tenancy import TenantDirectory, hash_api_key

# What `hash_api_key` produces: any other spelling (upper-case hex, other characters) would never match a key.
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


def build_policy(config: Config) -> PolicyChecker:
    """The PolicyChecker named by `policy.kind`."""
    factories: dict[str, Callable[[Config], PolicyChecker]] = {"static": _static_policy}
    factory = factories.get(config.policy.kind)
    if factory is None:
        raise ConfigError(f"policy.kind: unknown policy {config.policy.kind!r} (known: {', '.join(factories)})")
    return factory(config)


def _static_policy(config: Config) -> PolicyChecker:
    from policy.static import StaticPolicy

    limits = config.policy.static
    return StaticPolicy(max_tokens=limits.max_tokens, max_prompt_chars=limits.max_prompt_chars)


def build_protocols(config: Config) -> Callable[[Gateway], Sequence[ProtocolServer]]:
    """The protocol servers to run: REST, carrying the admin API and /metrics on the same port."""
    from protocols.rest import RestServer

    def make(gateway: Gateway) -> Sequence[ProtocolServer]:
        admin = AdminApi(gateway, admin_key_digests(config), base_model=config.model.name)
        metrics = gateway.metrics

        async def scrape(request: web.Request) -> web.Response:
            return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})

        s = config.server
        rest = RestServer(
            gateway,
            host=s.host,
            port=s.port,
            max_body_bytes=s.max_body_bytes,
            request_timeout_s=s.request_timeout_s,
            drain_timeout_s=s.drain_timeout_s,
            model_name=config.model.name,
            health=gateway,
            extra_routes=[*admin.routes(), web.get("/metrics", scrape)],
            tokens=gateway,
        )
        return [rest]

    return make


def admin_key_digests(config: Config) -> list[str]:
    return list(config.auth.admin_api_keys) + [hash_api_key(k) for k in config.auth.admin_plain_api_keys]


def validate(config: Config) -> None:
    """Checks that need more than one section; raises ConfigError naming the key."""
    try:
        directory = TenantDirectory.from_config(list(config.tenants))
    except GatewayError as e:
        raise ConfigError(e.message) from None
    anonymous = config.auth.anonymous_tenant
    if anonymous is not None and anonymous not in {t.name for t in directory.tenants()}:
        raise ConfigError(f"auth.anonymous_tenant: {anonymous!r} is not a configured tenant")
    for i, digest in enumerate(config.auth.admin_api_keys):
        if not _DIGEST_RE.fullmatch(digest):
            raise ConfigError(f"auth.admin_api_keys[{i}]: must be 'sha256:' + 64 lowercase hex digits")
    if config.engines.local.count == 0 and not config.engines.replicas:
        raise ConfigError("engines: no engine configured (engines.local.count is 0 and engines.replicas is empty)")
    build_policy(config)


def _announce_dev_keys(config: Config) -> None:
    dev_tenants = [t.get("name") for t in config.tenants if DEV_API_KEY in t.get("plain_api_keys", [])]
    if dev_tenants:
        print(f"adaptergate: development API key for tenant {dev_tenants[0]!r}: {DEV_API_KEY}", file=sys.stderr)
    if DEV_API_KEY in config.auth.admin_plain_api_keys:
        print(f"adaptergate: development admin key: {DEV_API_KEY} (configure auth.admin_api_keys)", file=sys.stderr)
    if config.auth.anonymous_tenant is not None:
        print(f"adaptergate: anonymous requests run as tenant {config.auth.anonymous_tenant!r}", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    from gateway import server

    config = _load(args.config)
    setup_logging(config.telemetry.log_level, config.telemetry.log_format)
    setup_tracing(config.telemetry.tracing)
    _announce_dev_keys(config)

    def on_ready(servers: Sequence[ProtocolServer]) -> None:
        port = getattr(servers[0], "port", config.server.port)
        print(f"adaptergate: serving on http://{config.server.host}:{port}", file=sys.stderr)
        if args.ready_file:
            tmp = f"{args.ready_file}.tmp"
            with open(tmp, "w") as f:
                json.dump({"port": port, "pid": os.getpid()}, f)
            os.replace(tmp, args.ready_file)

    return asyncio.run(
        server.run(config, policy=build_policy(config), protocols=build_protocols(config), on_ready=on_ready)
    )


def _engine(argv: list[str]) -> int:
    # Imported lazily: the engine pulls in torch, which the gateway itself never needs.
    from engine.__main__ import main as engine_main

    engine_main(argv, prog="adaptergate engine")
    return 0


def _config(args: argparse.Namespace) -> int:
    print(dump_yaml(_load(args.config)), end="")
    return 0


def _load(path: str | None) -> Config:
    config = load_config(path)
    validate(config)
    return config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["engine"]:
        return _engine(argv[1:])
    parser = argparse.ArgumentParser(prog="adaptergate", description="LoRA adapter gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the gateway and its local engines")
    serve.add_argument("--config", help="YAML config file (default: $ADAPTERGATE_CONFIG)")
    serve.add_argument("--ready-file", help='write {"port": N, "pid": P} here once serving')
    commands.add_parser("engine", help="run one engine process (arguments go to python -m engine)")
    show = commands.add_parser("config", help="print the effective configuration")
    show.add_argument("--config", help="YAML config file (default: $ADAPTERGATE_CONFIG)")
    args = parser.parse_args(argv)
    try:
        return _serve(args) if args.command == "serve" else _config(args)
    except ConfigError as e:
        print(f"adaptergate: configuration error: {e}", file=sys.stderr)
        return 2
    except GatewayError as e:  # e.g. an engine that exits or never gets ready while the gateway starts
        print(f"adaptergate: {e.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
