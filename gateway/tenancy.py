"""Tenants: who may call the gateway, with which API keys, weights, priorities and limits.

API keys are only ever held as `sha256:<hex>` digests; plain keys are accepted in configuration for
development only and are hashed on load.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest, NotFound, Unauthenticated

_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_MIN_WEIGHT, _MAX_WEIGHT = 1e-6, 1e6
_ENTRY_FIELDS = frozenset({"name", "api_keys", "plain_api_keys", "weight", "priority", "limits", "allowed_adapters"})
_LIMIT_FIELDS = frozenset({"max_queue_depth", "max_tokens_in_flight"})


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant's scheduling share and limits.

    `priority` selects a strict band (higher is served first); `weight` is the tenant's share of served
    tokens among tenants of the same band.
    """

    name: str
    weight: float = 1.0
    priority: int = 0
    max_queue_depth: int = 64
    max_tokens_in_flight: int = 32768
    allowed_adapters: tuple[str, ...] = ("*",)

    def may_use(self, adapter: str | None) -> bool:
        """Whether this tenant may call `adapter`; the base model (None) is always allowed."""
        if adapter is None:
            return True
        return "*" in self.allowed_adapters or adapter in self.allowed_adapters


def hash_api_key(key: str) -> str:
    """Return the stored form of an API key: `sha256:<hex digest>`."""
    # Header bytes that are not UTF-8 reach us as lone surrogates; "surrogatepass" hashes them (to bytes no
    # valid key has) instead of raising, and leaves every valid key's digest as it was.
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class TenantDirectory:
    """All tenants and the hashes of their API keys; read-only after construction."""

    def __init__(self, tenants: list[Tenant], key_hashes: list[tuple[str, str]]) -> None:
        """`key_hashes` pairs a `sha256:...` digest with the name of the tenant that owns it."""
        self._tenants = {t.name: t for t in tenants}
        self._keys = [(digest.encode("ascii"), name) for digest, name in key_hashes]

    @classmethod
    def from_config(cls, entries: list[dict[str, Any]]) -> TenantDirectory:
        """Build the directory from the `tenants` section of the config.

        Raises `InvalidRequest` naming the entry and field at fault.
        """
        if not isinstance(entries, list):
            raise InvalidRequest("tenants: must be a list of tenant entries")
        tenants: list[Tenant] = []
        keys: list[tuple[str, str]] = []
        owner: dict[str, str] = {}
        for index, entry in enumerate(entries):
            tenant, digests = _parse_entry(index, entry)
            if any(t.name == tenant.name for t in tenants):
                raise InvalidRequest(f"tenants[{index}].name: duplicate tenant {tenant.name!r}")
            for digest in digests:
                if digest in owner:
                    raise InvalidRequest(f"tenants[{index}].api_keys: key already belongs to tenant {owner[digest]!r}")
                owner[digest] = tenant.name
                keys.append((digest, tenant.name))
            tenants.append(tenant)
        return cls(tenants, keys)

    def authenticate(self, api_key: str | None) -> Tenant:
        """Return the tenant owning `api_key`; raise `Unauthenticated` when missing or unknown."""
        if not api_key:
            raise Unauthenticated("missing API key")
        presented = hash_api_key(api_key).encode("ascii")
        found: str | None = None
        # Compare against every stored hash without stopping early, so timing does not reveal which
        # (or whether any) prefix of the table matched.
        for digest, name in self._keys:
            if hmac.compare_digest(presented, digest):
                found = name
        if found is None:
            raise Unauthenticated("invalid API key")
        return self._tenants[found]

    def get(self, name: str) -> Tenant:
        """Return the tenant called `name`; raise `NotFound` if there is none."""
        try:
            return self._tenants[name]
        except KeyError:
            raise NotFound(f"unknown tenant {name!r}") from None

    def tenants(self) -> list[Tenant]:
        """All tenants, in configuration order."""
        return list(self._tenants.values())


def _parse_entry(index: int, entry: object) -> tuple[Tenant, list[str]]:
    where = f"tenants[{index}]"
    if not isinstance(entry, Mapping):
        raise InvalidRequest(f"{where}: must be a mapping")
    # key=str: YAML keys may be numbers or null besides strings, which do not compare with each other.
    unknown = sorted(set(entry) - _ENTRY_FIELDS, key=str)
    if unknown:
        raise InvalidRequest(f"{where}.{unknown[0]}: unknown field")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(f"{where}.name: must be 1-63 letters, digits, '_', '.' or '-'")
    where = f"tenants[{index}] ({name})"

    digests: list[str] = []
    for digest in _string_list(entry.get("api_keys", []), f"{where}.api_keys"):
        if not _HASH_RE.fullmatch(digest):
            raise InvalidRequest(f"{where}.api_keys: each key must be 'sha256:' + 64 lowercase hex digits")
        digests.append(digest)
    for plain in _string_list(entry.get("plain_api_keys", []), f"{where}.plain_api_keys"):
        if not plain:
            raise InvalidRequest(f"{where}.plain_api_keys: keys must not be empty")
        digests.append(hash_api_key(plain))

    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise InvalidRequest(f"{where}.weight: must be a positive number")
    # Bounded: the fair queue's virtual counters grow as tokens / weight, and one tenant's counter lifts those
    # of tenants coming back; at 1e-300 it reached 1e302, where the others' increments vanish in rounding.
    # The bounds also refuse NaN, infinities and integers past float's range (compared exactly, no overflow).
    if not _MIN_WEIGHT <= weight <= _MAX_WEIGHT:
        raise InvalidRequest(f"{where}.weight: must be between {_MIN_WEIGHT:g} and {_MAX_WEIGHT:g}, got {weight}")
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequest(f"{where}.priority: must be an integer")

    limits = entry.get("limits", {})
    if not isinstance(limits, Mapping):
        raise InvalidRequest(f"{where}.limits: must be a mapping")
    unknown = sorted(set(limits) - _LIMIT_FIELDS, key=str)
    if unknown:
        raise InvalidRequest(f"{where}.limits.{unknown[0]}: unknown field")
    bounds = {"max_queue_depth": 64, "max_tokens_in_flight": 32768}
    for field_name in bounds:
        value = limits.get(field_name, bounds[field_name])
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidRequest(f"{where}.limits.{field_name}: must be a positive integer")
        bounds[field_name] = value

    allowed = tuple(_string_list(entry.get("allowed_adapters", ["*"]), f"{where}.allowed_adapters"))
    tenant = Tenant(
        name=name,
        weight=float(weight),
        priority=priority,
        max_queue_depth=bounds["max_queue_depth"],
        max_tokens_in_flight=bounds["max_tokens_in_flight"],
        allowed_adapters=allowed,
    )
    return tenant, digests


def _string_list(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidRequest(f"{where}: must be a list of strings")
    return list(value)
