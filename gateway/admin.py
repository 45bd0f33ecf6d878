"""The admin HTTP API (what `adapterctl` talks to): adapters, their residency on engines, queues.

    POST   /admin/adapters        {"manifests": [AdapterInstance, ...]} (or a YAML body)
                                  -> {"applied": [AdapterInstance + "residency" + "result", ...]}
                                  (result: "created", "configured" or "unchanged", as kubectl says)
    GET    /admin/adapters        -> {"adapters": [AdapterInstance + "residency", ...]}
    GET    /admin/adapters/NAME   -> AdapterInstance + "residency": [{engine, version, state}, ...]
    DELETE /admin/adapters/NAME   -> {"deleted": NAME}
    GET    /admin/queues          -> {"tenants": {NAME: {depth, oldest_wait_s, served_tokens, ...}}}
    GET    /admin/engines         -> {"engines": {REPLICA: {address, healthy, in_flight, adapters, ...}}}

Every route needs an admin key (`Authorization: Bearer`); errors are raised as `GatewayError`s and
shaped by the REST server's error middleware like every other reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from gateway.core import Gateway
from gateway.errors import GatewayError, InvalidRequest, PermissionDenied, Unauthenticated
from gateway.registry import AdapterInstance, all_versions, parse_manifests
from gateway.tenancy import hash_api_key

_YAML_TYPES = frozenset({"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"})


class AdminApi:
    """Route handlers over one `Gateway`, guarded by a set of admin key digests."""

    def __init__(self, gateway: Gateway, key_digests: Sequence[str], base_model: str | None = None) -> None:
        """`base_model`: the name of the model the engines serve; manifests for another are refused."""
        self._gateway = gateway
        self._digests = [d.encode("ascii") for d in key_digests]
        self._base_model = base_model

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/admin/adapters", self._apply),
            web.get("/admin/adapters", self._list),
            web.get("/admin/adapters/{name}", self._get),
            web.delete("/admin/adapters/{name}", self._delete),
            web.get("/admin/queues", self._queues),
            web.get("/admin/engines", self._engines),
        ]

    def _authorize(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("admin API: missing API key (Authorization: Bearer <admin key>)")
        presented = hash_api_key(key.strip()).encode("ascii")
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(presented, digest)
        if not ok:
            raise PermissionDenied("admin API: this key is not an admin key")

    async def _apply(self, request: web.Request) -> web.Response:
        self._authorize(request)
        instances = await _read_manifests(request)
        for instance in instances:
            if self._base_model is not None and instance.base_model != self._base_model:
                # An adapter trained for another model loads only if its shapes happen to fit, and then says
                # nothing sensible: refused by name, before any engine is asked.
                raise InvalidRequest(
                    f"adapter {instance.name!r}: spec.baseModel {instance.base_model!r} is not the model this"
                    f" gateway serves ({self._base_model!r})"
                )
        registry = self._gateway.registry
        # The engine checks each source (files present, PEFT format, shapes that fit the base model) before
        # anything is stored: a bad manifest gets a 400 naming the problem, not a silent broken adapter.
        try:
            for instance in instances:
                await self._gateway.pool.adapters.validate(all_versions(instance))
        except GatewayError:
            # The check registered versions on an engine: those no traffic uses must not stay there (pinned, they
            # would hold a LoRA slot for good).
            in_use = {r.engine_name for r in registry.versions_in_use()}
            self._gateway.pool.adapters.retire({a.engine_name for i in instances for a in all_versions(i)} - in_use)
            raise
        # SQLite writes stay off the event loop; the registry is thread-safe.
        applied = [await asyncio.to_thread(registry.apply_and_report, instance) for instance in instances]
        return web.json_response({"applied": [{**self._describe(i), "result": outcome} for i, outcome in applied]})

    async def _list(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response({"adapters": [self._describe(i) for i in self._gateway.registry.list()]})

    async def _get(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response(self._describe(self._gateway.registry.get(request.match_info["name"])))

    async def _delete(self, request: web.Request) -> web.Response:
        self._authorize(request)
        name = request.match_info["name"]
        await asyncio.to_thread(self._gateway.registry.delete, name)
        return web.json_response({"deleted": name})

    async def _queues(self, request: web.Request) -> web.Response:
        self._authorize(request)
        stats = {name: dataclasses.asdict(s) for name, s in self._gateway.queue_stats().items()}
        return web.json_response({"tenants": stats, "total_depth": self._gateway.fair_queue.total_depth})

    async def _engines(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response({"engines": self._gateway.pool.residency()})

    def _describe(self, instance: AdapterInstance) -> dict[str, Any]:
        out = instance.to_dict()
        prefix = f"{instance.name}@"
        out["residency"] = [
            {"engine": replica, "version": name[len(prefix) :], "state": state}
            for replica, info in self._gateway.pool.residency().items()
            for name, state in _adapters_of(info).items()
            if name.startswith(prefix)
        ]
        return out


def _adapters_of(info: dict[str, object]) -> dict[str, str]:
    adapters = info.get("adapters")
    return adapters if isinstance(adapters, dict) else {}


async def _read_manifests(request: web.Request) -> list[AdapterInstance]:
    raw = await request.read()
    # Parsing and checking a body near the size limit takes up to seconds (PyYAML is pure Python; a JSON body
    # holds thousands of manifests), which must not stall every other request on the event loop.
    if request.content_type in _YAML_TYPES:
        return await asyncio.to_thread(_parse_yaml, raw)
    return await asyncio.to_thread(_parse_json, raw)


def _parse_yaml(raw: bytes) -> list[AdapterInstance]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        # Never replaced: a source path with U+FFFD in it names a file nobody wrote.
        raise InvalidRequest(f"request body is not UTF-8 text (byte {e.start})") from None
    return parse_manifests(text)


def _parse_json(raw: bytes) -> list[AdapterInstance]:
    try:
        body = json.loads(raw, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    manifests = body.get("manifests") if isinstance(body, dict) else None
    if not isinstance(manifests, list) or not manifests:
        raise InvalidRequest('body must be {"manifests": [AdapterInstance, ...]} with at least one manifest')
    instances = []
    for index, manifest in enumerate(manifests):
        try:
            instances.append(AdapterInstance.from_dict(manifest))
        except InvalidRequest as e:
            raise InvalidRequest(f"manifests[{index}]: {e.message}") from None
    seen: set[str] = set()
    for instance in instances:
        if instance.name in seen:
            raise InvalidRequest(f"manifests: {instance.name!r} appears more than once")
        seen.add(instance.name)
    return instances


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys, which would drop the first value without a word.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidRequest(f"request body: duplicate key {key!r}")
        out[key] = value
    return out
