from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest, NotFound, Unauthenticated
from gateway.tenancy import Tenant, TenantDirectory, hash_api_key


def _directory() -> TenantDirectory:
    return TenantDirectory.from_config(
        [
            {
                "name": "acme",
                "api_keys": [hash_api_key("acme-secret")],
                "weight": 3,
                "priority": 1,
                "limits": {"max_queue_depth": 8, "max_tokens_in_flight": 4096},
                "allowed_adapters": ["pirate", "shout"],
            },
            {"name": "dev", "plain_api_keys": ["dev-key", "dev-key-2"]},
        ]
    )


def test_hash_api_key_is_prefixed_sha256() -> None:
    digest = hash_api_key("abc")
    assert digest == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_from_config_reads_every_field() -> None:
    directory = _directory()
    acme = directory.get("acme")
    assert acme == Tenant(
        name="acme",
        weight=3.0,
        priority=1,
        max_queue_depth=8,
        max_tokens_in_flight=4096,
        allowed_adapters=("pirate", "shout"),
    )
    assert directory.get("dev") == Tenant(name="dev")
    assert [t.name for t in directory.tenants()] == ["acme", "dev"]


def test_authenticate_hashed_and_plain_keys() -> None:
    directory = _directory()
    assert directory.authenticate("acme-secret").name == "acme"
    assert directory.authenticate("dev-key").name == "dev"
    assert directory.authenticate("dev-key-2").name == "dev"


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("nope", "invalid API key"),
        (hash_api_key("acme-secret"), "invalid API key"),
        # aiohttp decodes header bytes that are not UTF-8 to lone surrogates; hashing them once raised a 500.
        (b"\xffacme".decode("utf-8", "surrogateescape"), "invalid API key"),
        ("\ud800", "invalid API key"),
    ],
)
def test_authenticate_rejects(key: str | None, message: str) -> None:
    with pytest.raises(Unauthenticated, match=message):
        _directory().authenticate(key)


def test_get_unknown_tenant() -> None:
    with pytest.raises(NotFound, match="ghost"):
        _directory().get("ghost")


def test_may_use() -> None:
    restricted = Tenant(name="a", allowed_adapters=("pirate",))
    assert restricted.may_use(None)
    assert restricted.may_use("pirate")
    assert not restricted.may_use("shout")
    assert Tenant(name="b").may_use("anything")
    assert not Tenant(name="c", allowed_adapters=()).may_use("pirate")


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({}, "tenants[0].name"),
        ({"name": "bad name"}, "tenants[0].name"),
        ({"name": "a", "api_keys": ["plaintext"]}, "api_keys"),
        ({"name": "a", "api_keys": "sha256:00"}, "api_keys"),
        ({"name": "a", "plain_api_keys": [""]}, "plain_api_keys"),
        ({"name": "a", "weight": 0}, "weight"),
        ({"name": "a", "weight": "3"}, "weight"),
        ({"name": "a", "weight": True}, "weight"),
        ({"name": "a", "priority": 1.5}, "priority"),
        ({"name": "a", "limits": {"max_queue_depth": 0}}, "limits.max_queue_depth"),
        ({"name": "a", "limits": {"max_tokens_in_flight": -1}}, "limits.max_tokens_in_flight"),
        ({"name": "a", "limits": {"max_depth": 3}}, "limits.max_depth"),
        ({"name": "a", "limits": [1]}, "limits"),
        ({"name": "a", "allowed_adapters": "pirate"}, "allowed_adapters"),
        ({"name": "a", "wieght": 2}, "wieght"),
        # Once a TypeError (unknown keys of mixed types do not sort) and an OverflowError: tracebacks at start-up.
        ({"name": "a", 1: "x", "zz": 2}, "tenants[0].1"),
        ({"name": "a", "limits": {None: 1, "x": 2}}, "limits.None"),
        ({"name": "a", "weight": 10**400}, "weight"),
        # A weight this small once broke fairness for every tenant of its band (counters past float precision).
        ({"name": "a", "weight": 1e-300}, "weight: must be between"),
        ({"name": "a", "weight": 1e9}, "weight: must be between"),
    ],
)
def test_from_config_names_the_bad_field(entry: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        TenantDirectory.from_config([entry])
    assert field in caught.value.message


def test_from_config_rejects_duplicates() -> None:
    with pytest.raises(InvalidRequest, match="duplicate tenant"):
        TenantDirectory.from_config([{"name": "a"}, {"name": "a"}])
    with pytest.raises(InvalidRequest, match="already belongs to tenant 'a'"):
        TenantDirectory.from_config(
            [{"name": "a", "plain_api_keys": ["k"]}, {"name": "b", "api_keys": [hash_api_key("k")]}]
        )
