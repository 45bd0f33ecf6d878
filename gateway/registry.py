"""Adapter registry: AdapterInstance specs, their versions and traffic split, persisted in SQLite.

An `AdapterInstance` names one adapter clients can ask for; its versions carry weights that split
traffic between them (canary roll-outs), and `pinnedVersion` overrides the split. Specs are kept in
memory for the request path and written through to SQLite so they survive a restart.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import logging
import random
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gateway.errors import InvalidRequest, NotFound, PermissionDenied
from gateway.manifest import AdapterInstance, AdapterVersion, parse_manifests

__all__ = [
    "AdapterInstance",
    "AdapterVersion",
    "ApplyOutcome",
    "Registry",
    "ResolvedAdapter",
    "parse_manifests",
]

log = logging.getLogger(__name__)

# What an apply did, in kubectl's words.
ApplyOutcome = Literal["created", "configured", "unchanged"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    name TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    spec TEXT NOT NULL
)
"""


@dataclass(frozen=True, slots=True)
class ResolvedAdapter:
    """The concrete version a request will run with; `engine_name` is what the engine loads it as."""

    name: str
    version: str
    source: str
    engine_name: str
    pin: bool
    priority: int


class Registry:
    """AdapterInstance specs by name, with a write-through SQLite store.

    Thread-safe: the admin API may write from a worker thread while requests resolve.
    """

    def __init__(self, connection: sqlite3.Connection) -> None:
        """Use `Registry.open`; this takes an already opened connection."""
        self._db = connection
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []
        self._db.execute(_SCHEMA)
        self._db.commit()
        self._instances: dict[str, AdapterInstance] = {}
        # Stored rows that no longer validate -> their generation: `delete` removes them, and an `apply` of the
        # name continues their generation.
        self._skipped: dict[str, int] = {}
        for name, generation, spec in self._db.execute("SELECT name, generation, spec FROM adapters ORDER BY name"):
            try:
                instance = AdapterInstance.from_dict(json.loads(spec))
            except (InvalidRequest, ValueError, RecursionError) as exc:
                # Stored before a rule was tightened (or torn): one such row must not stop the gateway, and the
                # row stays in the store untouched until it is applied again or deleted.
                reason = exc.message if isinstance(exc, InvalidRequest) else f"not JSON: {exc}"
                log.error("registry: skipping stored adapter %r, it is no longer valid: %s", name, reason)
                self._skipped[name] = generation
                continue
            self._instances[name] = _with_generation(instance, generation)

    @classmethod
    def open(cls, path: str) -> Registry:
        """Open (creating if needed) the registry stored at `path`; ":memory:" keeps nothing."""
        return cls(sqlite3.connect(path, check_same_thread=False))

    def close(self) -> None:
        """Close the store; the registry must not be used afterwards."""
        with self._lock:
            self._db.close()

    def apply(self, instance: AdapterInstance) -> AdapterInstance:
        """Create or replace the spec named `instance.name`; returns it with its generation."""
        return self.apply_and_report(instance)[0]

    def apply_and_report(self, instance: AdapterInstance) -> tuple[AdapterInstance, ApplyOutcome]:
        """`apply`, also saying what it did. As with Kubernetes, `generation` counts changes of the spec:
        applying the stored spec again leaves it (and the store) as it is."""
        with self._lock:
            previous = self._instances.get(instance.name)
            if previous is not None and _with_generation(instance, previous.generation) == previous:
                outcome: ApplyOutcome = "unchanged"
                stored = previous
            else:
                before = previous.generation if previous else self._skipped.get(instance.name, 0)
                outcome = "configured" if before else "created"
                stored = _with_generation(instance, before + 1)
                self._store(stored)
                self._skipped.pop(stored.name, None)
        # Listeners hear of an unchanged apply too: registering again is how an engine retries a failed load.
        self._notify(stored.name)
        return stored, outcome

    def _store(self, stored: AdapterInstance) -> None:
        with self._db:
            self._db.execute(
                "INSERT INTO adapters (name, generation, spec) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET generation = excluded.generation, spec = excluded.spec",
                (stored.name, stored.generation, json.dumps(stored.to_dict())),
            )
        self._instances[stored.name] = stored

    def get(self, name: str) -> AdapterInstance:
        """The spec called `name`; raises `NotFound`."""
        try:
            return self._instances[name]
        except KeyError:
            raise NotFound(f"adapter {name!r} not found") from None

    def list(self) -> list[AdapterInstance]:
        """Every spec, sorted by name."""
        return sorted(self._instances.values(), key=lambda i: i.name)

    def delete(self, name: str) -> None:
        """Remove the spec called `name` (a stored one skipped as no longer valid, too); raises `NotFound`."""
        with self._lock:
            if name not in self._instances and name not in self._skipped:
                raise NotFound(f"adapter {name!r} not found")
            with self._db:
                self._db.execute("DELETE FROM adapters WHERE name = ?", (name,))
            self._instances.pop(name, None)
            self._skipped.pop(name, None)
        self._notify(name)

    def resolve(self, name: str, tenant: str, routing_key: str | None, *, scope: str | None = None) -> ResolvedAdapter:
        """Pick the version of adapter `name` that serves this request.

        Raises `NotFound` for an unknown adapter and `PermissionDenied` when `tenant` is not allowed
        (or `scope`, e.g. "chat", is given and not among the adapter's scopes). The split follows the
        version weights; the same `routing_key` always lands on the same version while the weights
        stay the same, and None picks at random.
        """
        instance = self.get(name)
        if "*" not in instance.allowed_tenants and tenant not in instance.allowed_tenants:
            raise PermissionDenied(f"tenant {tenant!r} may not use adapter {name!r}")
        if scope is not None and scope not in instance.scopes:
            raise PermissionDenied(f"adapter {name!r} does not serve {scope!r} requests")
        return _resolved(instance, _pick_version(instance, routing_key))

    def versions_in_use(self) -> builtins.list[ResolvedAdapter]:
        """Every version that can receive traffic: the pinned one, else those with weight > 0."""
        out: builtins.list[ResolvedAdapter] = []
        for instance in self.list():
            for version in instance.versions:
                if instance.pinned_version is not None:
                    if version.name == instance.pinned_version:
                        out.append(_resolved(instance, version))
                elif version.weight > 0:
                    out.append(_resolved(instance, version))
        return out

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """Call `callback(name)` after each apply or delete (e.g. to load or unload engine adapters)."""
        self._listeners.append(callback)

    def _notify(self, name: str) -> None:
        for callback in list(self._listeners):
            try:
                callback(name)
            except Exception:
                # One broken listener must not undo a change already stored, nor starve the others.
                log.exception("registry listener failed for adapter %r", name)


def _with_generation(instance: AdapterInstance, generation: int) -> AdapterInstance:
    return dataclasses.replace(instance, generation=generation)


def _pick_version(instance: AdapterInstance, routing_key: str | None) -> AdapterVersion:
    if instance.pinned_version is not None:
        return next(v for v in instance.versions if v.name == instance.pinned_version)
    total = sum(v.weight for v in instance.versions)
    if routing_key is None:
        point = random.random() * total
    else:
        # A routing key from a header may hold lone surrogates (bytes that were not UTF-8): hash, never raise.
        digest = hashlib.sha256(f"{instance.name}\0{routing_key}".encode("utf-8", "surrogatepass")).digest()
        point = int.from_bytes(digest[:8], "big") / 2**64 * total
    for version in instance.versions:
        if version.weight > 0 and point < version.weight:
            return version
        point -= version.weight
    # Rounding can leave `point` a hair above the last bucket: the last weighted version owns it.
    return next(v for v in reversed(instance.versions) if v.weight > 0)


def all_versions(instance: AdapterInstance) -> builtins.list[ResolvedAdapter]:
    """Every version of `instance` as engines would load it (for validating a manifest before applying)."""
    return [_resolved(instance, v) for v in instance.versions]


def _resolved(instance: AdapterInstance, version: AdapterVersion) -> ResolvedAdapter:
    return ResolvedAdapter(
        name=instance.name,
        version=version.name,
        source=version.source,
        engine_name=f"{instance.name}@{version.name}",
        pin=instance.pin,
        priority=instance.priority,
    )
