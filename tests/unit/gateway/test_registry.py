from __future__ import annotations

import collections
import dataclasses
import json
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gateway.errors import InvalidRequest, NotFound, PermissionDenied
from gateway.registry import (
    AdapterInstance,
    AdapterVersion,
    Registry,
    ResolvedAdapter,
    parse_manifests,
)

MANIFESTS = """\
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
    - {name: v1, source: engine/demo_adapters/pirate, weight: 90}
    - {name: v2, source: /models/pirate-v2, weight: 10}
---
apiVersion: adapter.ai/v1
kind: AdapterInstance
metadata: {name: shout}
spec:
  baseModel: smollm2-135m-instruct
  allowedTenants: [acme]
  scopes: [chat]
  priority: 2
  pin: true
  versions:
    - {name: v1, source: shout-v1, weight: 1}
    - {name: v2, source: shout-v2, weight: 0}
"""


@pytest.fixture
def registry() -> Iterator[Registry]:
    reg = Registry.open(":memory:")
    for instance in parse_manifests(MANIFESTS):
        reg.apply(instance)
    yield reg
    reg.close()


def _doc(**spec_changes: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "baseModel": "m",
        "versions": [{"name": "v1", "source": "s", "weight": 1}],
    }
    spec.update(spec_changes)
    return {"apiVersion": "adapter.ai/v1", "kind": "AdapterInstance", "metadata": {"name": "a"}, "spec": spec}


def test_parse_reads_every_field() -> None:
    pirate, shout = parse_manifests(MANIFESTS)
    assert pirate == AdapterInstance(
        name="pirate",
        base_model="smollm2-135m-instruct",
        versions=(
            AdapterVersion("v1", "engine/demo_adapters/pirate", 90),
            AdapterVersion("v2", "/models/pirate-v2", 10),
        ),
    )
    assert (shout.allowed_tenants, shout.scopes, shout.priority, shout.pin) == (("acme",), ("chat",), 2, True)


def test_dict_round_trip_is_the_manifest_shape() -> None:
    for instance in parse_manifests(MANIFESTS):
        data = json.loads(json.dumps(instance.to_dict()))
        assert AdapterInstance.from_dict(data) == instance
        assert parse_manifests(yaml.safe_dump(data)) == [instance]


def test_parse_skips_empty_documents_and_accepts_json() -> None:
    assert [i.name for i in parse_manifests("---\n" + MANIFESTS + "\n---\n")] == ["pirate", "shout"]
    assert parse_manifests(json.dumps(_doc()))[0].name == "a"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("a: [", "not valid YAML"),
        ("", "no AdapterInstance documents"),
        ("- 1", "document 1: manifest: must be a mapping"),
        (json.dumps({**_doc(), "apiVersion": "v2"}), "apiVersion: must be 'adapter.ai/v1'"),
        (json.dumps({**_doc(), "kind": "Pod"}), "kind: must be 'AdapterInstance'"),
        (json.dumps({**_doc(), "metadata": {}}), "metadata.name"),
        (json.dumps({**_doc(), "metadata": {"name": "Pirate"}}), "metadata.name"),
        (json.dumps({**_doc(), "metadata": {"name": "x" * 64}}), "metadata.name"),
        (json.dumps({**_doc(), "metadata": {"name": "a", "labels": {}}}), "metadata.labels: unknown field"),
        (json.dumps({**_doc(), "extra": 1}), "extra: unknown field"),
        (json.dumps(_doc(baseModel="")), "spec.baseModel"),
        (json.dumps(_doc(versions=[])), "spec.versions: must be a non-empty list"),
        (json.dumps(_doc(versions=[{"name": "v1", "source": "s", "weight": 0}])), "add up to more than 0"),
        (json.dumps(_doc(versions=[{"name": "v1", "source": "s", "weight": -1}])), "versions[0].weight"),
        (json.dumps(_doc(versions=[{"name": "v1", "source": "s"}])), "versions[0].weight: required"),
        (json.dumps(_doc(versions=[{"name": "v@1", "source": "s", "weight": 1}])), "versions[0].name"),
        (json.dumps(_doc(versions=[{"name": "v1", "weight": 1}])), "versions[0].source"),
        (
            json.dumps(_doc(versions=[{"name": "v1", "source": "s", "weight": 1}] * 2)),
            "versions[1].name: duplicate version 'v1'",
        ),
        (json.dumps(_doc(pinnedVersion="v9")), "spec.pinnedVersion: 'v9'"),
        # Once a TypeError and an OverflowError: a 500 from the admin API instead of a 400.
        (json.dumps(_doc(pinnedVersion=["v1"])), "spec.pinnedVersion"),
        (json.dumps(_doc(versions=[{"name": "v1", "source": "s", "weight": 10**400}])), "versions[0].weight"),
        (json.dumps(_doc(priority="high")), "spec.priority"),
        (json.dumps(_doc(pin="yes")), "spec.pin"),
        (json.dumps(_doc(allowedTenants="acme")), "spec.allowedTenants"),
        (json.dumps(_doc(scopes=[""])), "spec.scopes"),
        (json.dumps(_doc(pinnedVerison="v1")), "spec.pinnedVerison: unknown field"),
        (MANIFESTS + "---\n" + MANIFESTS.split("---")[0], "document 3: adapter 'pirate' appears twice"),
        # DNS labels, as Kubernetes names: a leading '-' also reads as an option to `adapterctl delete`.
        (json.dumps({**_doc(), "metadata": {"name": "-pirate"}}), "metadata.name: must be a DNS label"),
        (json.dumps({**_doc(), "metadata": {"name": "pirate-"}}), "metadata.name: must be a DNS label"),
        (json.dumps({**_doc(), "metadata": {"name": "-"}}), "metadata.name: must be a DNS label"),
        # "base" names the base model in requests: an adapter called so could never be asked for by its name.
        (json.dumps({**_doc(), "metadata": {"name": "base"}}), "metadata.name: 'base' is reserved"),
        # A typo would store an adapter that refuses every request of the kind meant.
        (json.dumps(_doc(scopes=["chat", "completion"])), "spec.scopes: unknown scope 'completion'"),
        # PyYAML keeps the last of two equal keys: the first block would be dropped without a word.
        (
            MANIFESTS.replace("  pin: false\n", "  pin: false\n  pin: true\n"),
            "duplicate key 'pin'\n  in \"<unicode string>\", line 10",
        ),
        (MANIFESTS.replace("metadata: {name: pirate}", "metadata: {name: pirate, name: french}"), "duplicate key"),
    ],
)
def test_parse_names_what_is_wrong(text: str, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_manifests(text)
    assert fragment in caught.value.message


def test_apply_bumps_generation_and_get_list(registry: Registry) -> None:
    assert registry.get("pirate").generation == 1
    changed = dataclasses.replace(registry.get("pirate"), pinned_version="v2")
    stored = registry.apply(changed)
    assert stored.generation == 2
    assert registry.get("pirate") == stored
    assert [i.name for i in registry.list()] == ["pirate", "shout"]


def test_get_and_delete_unknown(registry: Registry) -> None:
    with pytest.raises(NotFound, match="'nope'"):
        registry.get("nope")
    with pytest.raises(NotFound, match="adapter 'nope' not found"):
        registry.delete("nope")
    registry.delete("shout")
    with pytest.raises(NotFound, match="adapter 'shout' not found"):
        registry.get("shout")


def test_survives_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "registry.sqlite")
    reg = Registry.open(path)
    for instance in parse_manifests(MANIFESTS):
        reg.apply(instance)
    reg.apply(dataclasses.replace(reg.get("pirate"), pin=True))
    reg.delete("shout")
    reg.close()
    reopened = Registry.open(path)
    pirate = reopened.get("pirate")
    assert pirate.generation == 2
    assert pirate.versions == parse_manifests(MANIFESTS)[0].versions
    assert [i.name for i in reopened.list()] == ["pirate"]
    assert reopened.apply(dataclasses.replace(pirate, pin=False)).generation == 3
    reopened.close()


def test_unchanged_spec_keeps_its_generation(tmp_path: Path) -> None:
    # kubectl semantics: generation counts changes of the spec; applying the same manifest again changes nothing.
    path = str(tmp_path / "registry.sqlite")
    reg = Registry.open(path)
    pirate = parse_manifests(MANIFESTS)[0]
    assert reg.apply(pirate).generation == 1
    assert reg.apply(pirate).generation == 1
    assert reg.apply(dataclasses.replace(pirate, generation=7)).generation == 1
    assert reg.apply_and_report(pirate) == (reg.get("pirate"), "unchanged")
    changed, outcome = reg.apply_and_report(dataclasses.replace(pirate, pin=True))
    assert (changed.generation, outcome) == (2, "configured")
    assert reg.apply_and_report(parse_manifests(MANIFESTS)[1])[1] == "created"
    reg.close()
    reopened = Registry.open(path)
    assert reopened.get("pirate").generation == 2
    reopened.close()


def test_stored_spec_that_no_longer_validates_is_skipped_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Rows written before a rule was tightened (names like "-x" were once accepted) must not stop the start.
    path = str(tmp_path / "registry.sqlite")
    reg = Registry.open(path)
    reg.apply(parse_manifests(MANIFESTS)[0])
    reg.close()
    with sqlite3.connect(path) as db:
        old = {**_doc(), "metadata": {"name": "-old", "generation": 3}}
        db.execute("INSERT INTO adapters (name, generation, spec) VALUES (?, ?, ?)", ("-old", 3, json.dumps(old)))
        db.execute("INSERT INTO adapters (name, generation, spec) VALUES (?, ?, ?)", ("torn", 1, "{"))
    db.close()
    with caplog.at_level(logging.ERROR, logger="gateway.registry"):
        reopened = Registry.open(path)
    assert [i.name for i in reopened.list()] == ["pirate"]
    assert "'-old'" in caplog.text and "metadata.name" in caplog.text and "'torn'" in caplog.text
    reopened.close()


def test_a_skipped_stored_spec_can_be_deleted_and_applied_again_without_losing_its_generation(
    tmp_path: Path,
) -> None:
    # A skipped row stayed in the store for good: `adapterctl delete -old` said "not found" (so the error came back
    # at every start), and applying the name again restarted its generation at 1 ("created") over the stored 3.
    path = str(tmp_path / "registry.sqlite")
    Registry.open(path).close()
    with sqlite3.connect(path) as db:
        old = {**_doc(), "metadata": {"name": "-old", "generation": 3}}
        db.execute("INSERT INTO adapters (name, generation, spec) VALUES (?, ?, ?)", ("-old", 3, json.dumps(old)))
        stale = _doc(scopes=["embeddings"])  # a scope once accepted
        db.execute("INSERT INTO adapters (name, generation, spec) VALUES (?, ?, ?)", ("a", 5, json.dumps(stale)))
    db.close()
    reopened = Registry.open(path)
    assert reopened.list() == []
    reopened.delete("-old")
    fixed, outcome = reopened.apply_and_report(AdapterInstance.from_dict(_doc(scopes=["chat"])))
    assert (fixed.generation, outcome) == (6, "configured")
    reopened.close()
    again = Registry.open(path)
    assert [(i.name, i.generation) for i in again.list()] == [("a", 6)]
    with pytest.raises(NotFound):
        again.delete("-old")
    again.close()


def test_manifest_read_back_from_the_admin_api_applies_again() -> None:
    # `adapterctl get NAME -o yaml > f.yaml; adapterctl apply -f f.yaml`: the reply adds read-only residency.
    data = {**parse_manifests(MANIFESTS)[0].to_dict(), "residency": [{"engine": "e0", "version": "v1", "state": "gpu"}]}
    assert parse_manifests(yaml.safe_dump(data)) == parse_manifests(MANIFESTS)[:1]
    with pytest.raises(InvalidRequest, match="residency: must be a list"):
        AdapterInstance.from_dict({**data, "residency": "gpu"})


def test_resolve_permissions_and_scope(registry: Registry) -> None:
    with pytest.raises(NotFound, match="adapter 'nope' not found"):
        registry.resolve("nope", "acme", None)
    with pytest.raises(PermissionDenied, match="tenant 'other' may not use adapter 'shout'"):
        registry.resolve("shout", "other", None)
    assert registry.resolve("shout", "acme", None, scope="chat").version == "v1"
    with pytest.raises(PermissionDenied, match="completions"):
        registry.resolve("shout", "acme", None, scope="completions")
    assert registry.resolve("pirate", "anyone", "k") in (
        ResolvedAdapter("pirate", "v1", "engine/demo_adapters/pirate", "pirate@v1", False, 0),
        ResolvedAdapter("pirate", "v2", "/models/pirate-v2", "pirate@v2", False, 0),
    )


def test_split_follows_weights_and_is_sticky(registry: Registry) -> None:
    keyed = collections.Counter(registry.resolve("pirate", "t", f"user-{i}").version for i in range(5000))
    assert 0.08 < keyed["v2"] / 5000 < 0.12
    unkeyed = collections.Counter(registry.resolve("pirate", "t", None).version for _ in range(5000))
    assert 0.08 < unkeyed["v2"] / 5000 < 0.12
    for i in range(200):
        first = registry.resolve("pirate", "t", f"user-{i}").version
        assert all(registry.resolve("pirate", "t", f"user-{i}").version == first for _ in range(5))


def test_routing_key_that_is_not_valid_unicode_is_still_sticky(registry: Registry) -> None:
    # An X-Routing-Key header with bytes that are not UTF-8 arrives as lone surrogates; hashing it once raised.
    # Many such keys, each resolved 20 times: a key picked at random (90/10) would come out the same every
    # time with a chance of about 0.12, so a fallback to the unkeyed random pick cannot pass.
    keys = [b"user-%d-\xff" % i for i in range(20)]
    for key in [*(k.decode("utf-8", "surrogateescape") for k in keys), "\ud800", "a\udc80b"]:
        first = registry.resolve("pirate", "t", key).version
        assert all(registry.resolve("pirate", "t", key).version == first for _ in range(20)), repr(key)


def test_zero_weight_version_gets_no_traffic(registry: Registry) -> None:
    assert {registry.resolve("shout", "acme", f"k{i}").version for i in range(500)} == {"v1"}


def test_pinned_version_overrides_weights(registry: Registry) -> None:
    registry.apply(dataclasses.replace(registry.get("pirate"), pinned_version="v2"))
    assert {registry.resolve("pirate", "t", f"k{i}").version for i in range(200)} == {"v2"}
    assert {registry.resolve("pirate", "t", None).version for _ in range(200)} == {"v2"}


def test_versions_in_use(registry: Registry) -> None:
    assert [(r.engine_name, r.pin, r.priority) for r in registry.versions_in_use()] == [
        ("pirate@v1", False, 0),
        ("pirate@v2", False, 0),
        ("shout@v1", True, 2),
    ]
    registry.apply(dataclasses.replace(registry.get("pirate"), pinned_version="v2"))
    registry.apply(dataclasses.replace(registry.get("shout"), pinned_version="v2"))
    assert [r.engine_name for r in registry.versions_in_use()] == ["pirate@v2", "shout@v2"]


def test_listeners_called_after_apply_and_delete(registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[str, int]] = []

    def broken(name: str) -> None:
        raise RuntimeError("listener bug")

    def record(name: str) -> None:
        # Called after the change is visible.
        seen.append((name, len(registry.list())))

    registry.add_listener(broken)
    registry.add_listener(record)
    with caplog.at_level(logging.ERROR, logger="gateway.registry"):
        registry.apply(parse_manifests(MANIFESTS.replace("name: pirate", "name: french"))[0])
        registry.delete("shout")
    assert seen == [("french", 3), ("shout", 2)]
    assert "listener failed" in caplog.text
