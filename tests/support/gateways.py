"""A gateway core over fast engine fixtures, as the gateway's unit tests run it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from gateway.api import PolicyChecker
from gateway.core import Gateway
from gateway.engine_client import EnginePool
from gateway.queue import QueueLimits
from gateway.registry import Registry
from gateway.tenancy import TenantDirectory
from policy.static import StaticPolicy


@asynccontextmanager
async def serving_gateway(
    addresses: Sequence[str],
    registry: Registry,
    tenants: list[dict[str, Any]],
    *,
    capacity: int = 32,
    policy: PolicyChecker | None = None,
    poll_s: float = 0.05,
) -> AsyncIterator[Gateway]:
    """A started `Gateway` over engines at `addresses` (`capacity` requests each), polled every `poll_s`."""
    pool = EnginePool(addresses, max_concurrency=capacity, poll_interval_s=poll_s, rpc_timeout_s=0.5)
    async with pool:
        gateway = Gateway(
            tenants=TenantDirectory.from_config(tenants),
            policy=policy or StaticPolicy(max_tokens=1000),
            registry=registry,
            pool=pool,
            limits=QueueLimits(),
            default_max_tokens=16,
        )
        async with gateway:
            yield gateway
