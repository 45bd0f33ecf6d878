"""AdapterInstance manifests: the YAML/JSON shape, its validation, and the frozen spec it becomes.

```yaml
apiVersion: adapter.ai/v1
kind: AdapterInstance
metadata: {name: pirate}
spec:
  baseModel: smollm2-135m-instruct
  allowedTenants: ["*"]
  scopes: ["chat", "completions"]
  priority: 0
  pin: false
  pinnedVersion: null
  versions:
    - {name: v1, source: engine/demo_adapters/pirate, weight: 100}
```
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from gateway.errors import InvalidRequest

API_VERSION = "adapter.ai/v1"
KIND = "AdapterInstance"
DEFAULT_SCOPES = ("chat", "completions")
# The request kinds the gateway tells apart (core: chat messages -> "chat", a prompt -> "completions").
SCOPES = frozenset(DEFAULT_SCOPES)
# Requests say "base" for the base model (protocols/rest_input.parse_model): an adapter of that name is unreachable.
RESERVED_NAMES = frozenset({"base"})

# A DNS label (RFC 1123), as Kubernetes names are.
_NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# Versions become part of the engine name "<adapter>@<version>", so '@' is kept out.
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
# `residency` is what the admin API reports beside a manifest; it is read-only and ignored here, so that
# what `adapterctl get NAME -o yaml` prints can be applied again.
_TOP_FIELDS = frozenset({"apiVersion", "kind", "metadata", "spec", "residency"})
_METADATA_FIELDS = frozenset({"name", "generation"})
_SPEC_FIELDS = frozenset({"baseModel", "allowedTenants", "scopes", "priority", "pin", "pinnedVersion", "versions"})
_VERSION_FIELDS = frozenset({"name", "source", "weight"})


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """One trained adapter behind an AdapterInstance; `weight` is its share of traffic."""

    name: str
    source: str
    weight: float


@dataclass(frozen=True, slots=True)
class AdapterInstance:
    """A named adapter clients can ask for. `generation` counts applies (0 = never stored)."""

    name: str
    base_model: str
    versions: tuple[AdapterVersion, ...]
    allowed_tenants: tuple[str, ...] = ("*",)
    scopes: tuple[str, ...] = DEFAULT_SCOPES
    priority: int = 0
    pin: bool = False
    pinned_version: str | None = None
    generation: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The manifest shape (JSON-able), with `metadata.generation` added."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": self.name, "generation": self.generation},
            "spec": {
                "baseModel": self.base_model,
                "allowedTenants": list(self.allowed_tenants),
                "scopes": list(self.scopes),
                "priority": self.priority,
                "pin": self.pin,
                "pinnedVersion": self.pinned_version,
                "versions": [{"name": v.name, "source": v.source, "weight": v.weight} for v in self.versions],
            },
        }

    @classmethod
    def from_dict(cls, data: object) -> AdapterInstance:
        """Validate one manifest; raises `InvalidRequest` naming the field at fault."""
        top = _mapping(data, "manifest", _TOP_FIELDS)
        if top.get("apiVersion") != API_VERSION:
            raise InvalidRequest(f"apiVersion: must be {API_VERSION!r}, got {top.get('apiVersion')!r}")
        if top.get("kind") != KIND:
            raise InvalidRequest(f"kind: must be {KIND!r}, got {top.get('kind')!r}")
        metadata = _mapping(top.get("metadata"), "metadata", _METADATA_FIELDS)
        name = metadata.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise InvalidRequest(
                "metadata.name: must be a DNS label (1-63 lowercase letters, digits or '-', starting and ending"
                f" with a letter or digit), got {name!r}"
            )
        if name in RESERVED_NAMES:
            raise InvalidRequest(f"metadata.name: {name!r} is reserved (requests use it for the base model)")
        if not isinstance(top.get("residency", []), list):
            raise InvalidRequest("residency: must be a list (it is read-only: leave it out)")
        generation = metadata.get("generation", 0)
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise InvalidRequest("metadata.generation: must be a non-negative integer")

        spec = _mapping(top.get("spec"), "spec", _SPEC_FIELDS)
        base_model = spec.get("baseModel")
        if not isinstance(base_model, str) or not base_model:
            raise InvalidRequest("spec.baseModel: required, a non-empty string")
        versions = _versions(spec.get("versions"))
        pinned = spec.get("pinnedVersion")
        # isinstance first: a list or mapping is unhashable and would raise inside the set lookup.
        if pinned is not None and (not isinstance(pinned, str) or pinned not in {v.name for v in versions}):
            raise InvalidRequest(f"spec.pinnedVersion: {pinned!r} is not one of spec.versions")
        priority = spec.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequest("spec.priority: must be an integer")
        pin = spec.get("pin", False)
        if not isinstance(pin, bool):
            raise InvalidRequest("spec.pin: must be true or false")
        return cls(
            name=name,
            base_model=base_model,
            versions=versions,
            allowed_tenants=_strings(spec.get("allowedTenants", ["*"]), "spec.allowedTenants"),
            scopes=_scopes(spec.get("scopes", list(DEFAULT_SCOPES))),
            priority=priority,
            pin=pin,
            pinned_version=pinned,
            generation=generation,
        )


def parse_manifests(text: str) -> list[AdapterInstance]:
    """Parse a (multi-document) YAML or JSON text into AdapterInstances.

    Empty documents are skipped. Raises `InvalidRequest` naming the document and field at fault.
    """
    try:
        documents = list(yaml.load_all(text, Loader=_StrictLoader))
    except (yaml.YAMLError, ValueError) as exc:
        # ValueError: PyYAML converts integers with int(), which refuses more than 4300 digits.
        raise InvalidRequest(f"not valid YAML: {exc}") from None
    except RecursionError:
        # PyYAML composes nested collections recursively: a body of a few thousand '[' exhausts the stack.
        raise InvalidRequest("not valid YAML: nested too deeply") from None
    out: list[AdapterInstance] = []
    names: set[str] = set()
    for number, document in enumerate(documents, start=1):
        if document is None:
            continue
        try:
            instance = AdapterInstance.from_dict(document)
        except InvalidRequest as exc:
            raise InvalidRequest(f"document {number}: {exc.message}") from None
        if instance.name in names:
            raise InvalidRequest(f"document {number}: adapter {instance.name!r} appears twice")
        names.add(instance.name)
        out.append(instance)
    if not out:
        raise InvalidRequest("no AdapterInstance documents found")
    return out


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key twice in one mapping is an error instead of "the last wins"."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            # Merge keys (`<<: *anchor`) may be overridden by design; only the mapping's own scalar keys count.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _versions(value: object) -> tuple[AdapterVersion, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("spec.versions: must be a non-empty list")
    versions: list[AdapterVersion] = []
    # A set, not a scan of `versions`: ~20k versions fit in one request body, and a quadratic check of them
    # held the event loop (every request of every tenant) for seconds.
    names: set[str] = set()
    for index, item in enumerate(value):
        where = f"spec.versions[{index}]"
        fields = _mapping(item, where, _VERSION_FIELDS)
        name = fields.get("name")
        if not isinstance(name, str) or not _VERSION_RE.fullmatch(name):
            raise InvalidRequest(f"{where}.name: must be 1-63 letters, digits, '.', '_' or '-'")
        if name in names:
            raise InvalidRequest(f"{where}.name: duplicate version {name!r}")
        names.add(name)
        source = fields.get("source")
        if not isinstance(source, str) or not source:
            raise InvalidRequest(f"{where}.source: required, a non-empty string")
        if not _encodable(source):
            # JSON and YAML escapes can spell lone surrogates; the engine's wire format only carries UTF-8.
            raise InvalidRequest(f"{where}.source: must be valid Unicode text (no lone surrogates)")
        weight = fields.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not _finite(weight) or weight < 0:
            raise InvalidRequest(f"{where}.weight: required, a non-negative number")
        versions.append(AdapterVersion(name=name, source=source, weight=weight))
    if sum(v.weight for v in versions) <= 0:
        raise InvalidRequest("spec.versions: weights must add up to more than 0")
    return tuple(versions)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond float range; every split computed from it would overflow too
        return False


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _mapping(value: object, where: str, allowed: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{where}: must be a mapping")
    unknown = sorted(str(key) for key in value if key not in allowed)
    if unknown:
        prefix = "" if where == "manifest" else f"{where}."
        raise InvalidRequest(f"{prefix}{unknown[0]}: unknown field")
    return value


def _scopes(value: object) -> tuple[str, ...]:
    scopes = _strings(value, "spec.scopes")
    for scope in scopes:
        if scope not in SCOPES:
            raise InvalidRequest(f"spec.scopes: unknown scope {scope!r} (known: {', '.join(sorted(SCOPES))})")
    return scopes


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise InvalidRequest(f"{where}: must be a list of non-empty strings")
    return tuple(value)
