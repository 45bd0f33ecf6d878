"""The gateway's lifecycle: start engines, registry, pool, core and protocols in order; drain on SIGTERM.

Components are async context managers entered in dependency order and left in reverse, so on SIGTERM
(or SIGINT) the protocols stop accepting first (503 for new requests), in-flight requests finish, and
only then the engines stop. What is wired in (policy, protocols) comes from the composition root.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import os
import signal
import sqlite3
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gateway.api import PolicyChecker, ProtocolServer
from gateway.config import Config, ConfigError
from gateway.core import Gateway
from gateway.engine_client import EnginePool
from gateway.engine_process import LocalEngine, engine_command
from gateway.metrics import GatewayMetrics
from gateway.queue import QueueLimits
from gateway.registry import AdapterInstance, AdapterVersion, Registry
from gateway.replica import Replica
from gateway.tenancy import TenantDirectory

log = logging.getLogger("adaptergate.server")

ProtocolFactory = Callable[[Gateway], Sequence[ProtocolServer]]
T = TypeVar("T")


async def run(
    config: Config,
    *,
    policy: PolicyChecker,
    protocols: ProtocolFactory,
    on_ready: Callable[[Sequence[ProtocolServer]], None] = lambda servers: None,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then drain and return the exit status."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with contextlib.AsyncExitStack() as stack:
            # Engines may take minutes to load their model: SIGTERM must not wait for them to be ready first.
            locals_ = await _unless_stopped(_start_local_engines(config, stack), stop)
            if locals_ is None:
                log.info("stopped while engines were starting")
                return 0
            registry = _open_registry(config)
            stack.callback(registry.close)
            pool = EnginePool(
                [address for _, address in locals_] + list(config.engines.replicas),
                max_concurrency=config.engines.max_concurrency,
                poll_interval_s=config.engines.poll_interval_s,
                rpc_timeout_s=config.engines.rpc_timeout_s,
            )
            await stack.enter_async_context(pool)
            for (engine, _), replica in zip(locals_, pool.replicas, strict=False):
                engine.supervise(_repoint(pool, replica))
            metrics = GatewayMetrics()
            stack.callback(metrics.shutdown)
            gateway = Gateway(
                tenants=TenantDirectory.from_config(list(config.tenants)),
                policy=policy,
                registry=registry,
                pool=pool,
                limits=QueueLimits(config.queue.max_total_depth, config.queue.max_total_tokens_in_flight),
                default_max_tokens=config.queue.default_max_tokens,
                anonymous_tenant=config.auth.anonymous_tenant,
                metrics=metrics,
                access_log_enabled=config.telemetry.access_log,
            )
            await stack.enter_async_context(gateway)
            servers = list(protocols(gateway))
            for server in servers:
                await stack.enter_async_context(server)
            on_ready(servers)
            log.info("gateway serving", extra={"pid": os.getpid(), "engines": len(pool.replicas)})
            await stop.wait()
            log.info("draining: refusing new requests, finishing in-flight ones")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("gateway stopped")
    return 0


async def _start_local_engines(config: Config, stack: contextlib.AsyncExitStack) -> list[tuple[LocalEngine, str]]:
    local = config.engines.local
    command = engine_command(local)
    engines = [
        LocalEngine(command, name=f"engine-{i}", start_timeout_s=local.start_timeout_s) for i in range(local.count)
    ]
    for engine in engines:
        stack.push_async_callback(engine.stop)
    addresses = await asyncio.gather(*(engine.start() for engine in engines))
    return list(zip(engines, addresses, strict=True))


async def _unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """The result of `work`, or None once `stop` is set first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


def _repoint(pool: EnginePool, replica: Replica) -> Callable[[str], None]:
    return lambda address: pool.set_address(replica, address)


def _open_registry(config: Config) -> Registry:
    path = config.registry.path
    try:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        registry = Registry.open(path)
    except (OSError, sqlite3.Error) as e:  # a folder there, no write access, a file that is not SQLite
        raise ConfigError(f"registry.path: cannot open {path!r} as the adapter registry: {e}") from None
    if config.registry.seed_demo_adapters and not registry.list():
        for instance in demo_adapters(config.model.name):
            registry.apply(instance)
            log.info("registered demo adapter", extra={"adapter": instance.name})
    return registry


def demo_adapters(base_model: str) -> list[AdapterInstance]:
    """One AdapterInstance per trained adapter folder shipped in engine/demo_adapters."""
    root = Path(str(importlib.resources.files("engine") / "demo_adapters"))
    if not root.is_dir():
        log.warning("no demo adapters found under %s", root)
        return []
    return [
        AdapterInstance(
            name=folder.name,
            base_model=base_model,
            versions=(AdapterVersion("v1", str(folder.resolve()), 100.0),),
        )
        for folder in sorted(root.iterdir())
        if (folder / "adapter_config.json").is_file()
    ]
