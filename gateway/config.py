"""The gateway's one config tree: typed frozen sections, read and validated once at start-up.

Sources, later ones winning: the embedded defaults below, one YAML file (`--config` or the
`ADAPTERGATE_CONFIG` environment variable), then `ADAPTERGATE__SECTION__KEY=value` environment
variables whose values are parsed as YAML scalars or flow collections (`8080`, `true`, `[a, b]`).
Every problem is reported as `ConfigError` naming the dotted key at fault.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ENV_FILE = "ADAPTERGATE_CONFIG"
ENV_PREFIX = "ADAPTERGATE__"
# The development key of the embedded default tenant; printed at start whenever it is active.
DEV_API_KEY = "sk-adaptergate-dev"
# gRPC deadlines are int64 nanoseconds of wall-clock time: a timeout of about 7e9 s or more overflows into a
# deadline already passed, so every engine call would fail at once.
_MAX_TIMEOUT_S = 1e9


class ConfigError(ValueError):
    """The configuration is unusable; the message names the key at fault."""


def _dev_tenants() -> tuple[dict[str, Any], ...]:
    return ({"name": "default", "plain_api_keys": [DEV_API_KEY]},)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = field(default=8080, metadata={"min": 0, "max": 65535})
    max_body_bytes: int = field(default=1_048_576, metadata={"min": 1024})
    # Default deadline of a request (queue wait + generation); clients may ask for less.
    request_timeout_s: float = field(default=600.0, metadata={"min": 0.001, "max": _MAX_TIMEOUT_S})
    drain_timeout_s: float = field(default=30.0, metadata={"min": 0.0})


@dataclass(frozen=True, slots=True)
class AuthConfig:
    # Tenant that requests without an API key run as; None (the default) rejects them with 401.
    anonymous_tenant: str | None = None
    # Keys allowed on /admin: "sha256:<hex>" digests, or plain keys (development only).
    admin_api_keys: tuple[str, ...] = ()
    admin_plain_api_keys: tuple[str, ...] = (DEV_API_KEY,)


@dataclass(frozen=True, slots=True)
class QueueConfig:
    max_total_depth: int = field(default=1024, metadata={"min": 1})
    max_total_tokens_in_flight: int = field(default=262_144, metadata={"min": 1})
    # max_tokens assumed for admission and fairness when a request does not say.
    default_max_tokens: int = field(default=256, metadata={"min": 1})


@dataclass(frozen=True, slots=True)
class LocalEngineConfig:
    """Engine processes the gateway starts and stops itself."""

    count: int = field(default=1, metadata={"min": 0})
    # Command to start one engine; empty = this Python running `-m engine`. The ready-file and
    # port arguments are appended.
    command: tuple[str, ...] = ()
    device: str = "auto"
    # Checked here, not only by the engine: an engine that refuses its flags exits at start-up, which reads as
    # "engine exited with status 2" rather than the setting at fault.
    max_num_seqs: int | None = field(default=None, metadata={"min": 1})
    max_model_len: int | None = field(default=None, metadata={"min": 1})
    extra_args: tuple[str, ...] = ()
    start_timeout_s: float = field(default=300.0, metadata={"min": 1.0})


@dataclass(frozen=True, slots=True)
class EnginesConfig:
    # Addresses ("host:port") of engines started elsewhere, used in addition to local ones.
    replicas: tuple[str, ...] = ()
    local: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    # Requests this gateway keeps running on one replica at a time; the rest wait in the fair queue.
    max_concurrency: int = field(default=32, metadata={"min": 1})
    poll_interval_s: float = field(default=1.0, metadata={"min": 0.01})
    rpc_timeout_s: float = field(default=5.0, metadata={"min": 0.01, "max": _MAX_TIMEOUT_S})


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    path: str = "var/registry.db"
    # Register the demo adapters shipped in engine/demo_adapters when the registry is empty.
    seed_demo_adapters: bool = True


@dataclass(frozen=True, slots=True)
class StaticPolicyConfig:
    max_tokens: int = field(default=4096, metadata={"min": 1})
    max_prompt_chars: int = field(default=200_000, metadata={"min": 1})


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    kind: str = "static"
    static: StaticPolicyConfig = field(default_factory=StaticPolicyConfig)
    # Settings for other policy kinds, handed over as they are.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TelemetryConfig:
    log_level: str = field(default="info", metadata={"choices": ("debug", "info", "warning", "error")})
    log_format: str = field(default="json", metadata={"choices": ("json", "text")})
    # One log line per finished request (request id, tenant, status, latency).
    access_log: bool = True
    # "sdk": spans recorded with no exporter; "console": printed; "off": no-op tracer.
    tracing: str = field(default="sdk", metadata={"choices": ("off", "sdk", "console")})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # Name of the base model, listed by /v1/models as owner of "base" and accepted as an alias of it.
    name: str = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tenants: tuple[dict[str, Any], ...] = field(default_factory=_dev_tenants)
    queue: QueueConfig = field(default_factory=QueueConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    model: ModelConfig = field(default_factory=ModelConfig)


def load_config(path: str | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Build the effective config from defaults, the YAML file and environment overrides."""
    env = os.environ if environ is None else environ
    path = path or env.get(ENV_FILE) or None
    data: dict[str, Any] = {}
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start})") from None
        try:
            loaded = yaml.safe_load(text)
        except (yaml.YAMLError, ValueError) as e:
            # ValueError: PyYAML converts integers with int(), which refuses more than 4300 digits.
            raise ConfigError(f"config file {path}: invalid YAML: {e}") from None
        except RecursionError:
            raise ConfigError(f"config file {path}: invalid YAML: nested too deeply") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
        data = loaded or {}
    for name, raw in sorted(env.items()):
        if name.startswith(ENV_PREFIX):
            _apply_override(data, name, raw)
    return from_dict(data)


def from_dict(data: Mapping[str, Any]) -> Config:
    """Validate a plain (YAML-shaped) mapping into a `Config`."""
    return _build(Config, data, "")


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain YAML-friendly data (tuples become lists)."""
    return typing.cast(dict[str, Any], _plain(dataclasses.asdict(config)))


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def _apply_override(data: dict[str, Any], name: str, raw: str) -> None:
    keys = [k.lower() for k in name[len(ENV_PREFIX) :].split("__")]
    if not all(keys):
        raise ConfigError(f"environment {name}: empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError):
        value = raw
    node = data
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"environment {name}: {'.'.join(keys[: depth + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def _build(cls: type[Any], data: object, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {_describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    # key=str: YAML keys may be numbers or null besides strings, which do not compare with each other.
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise ConfigError(f"{key}: unknown key (known: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        values[name] = _convert(hints[name], value, key)
        _check_bounds(fields[name], values[name], key)
    return cls(**values)


def _convert(hint: Any, value: object, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(typing.cast(type[Any], hint), value, key)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {_describe(value)}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond float's range
                number = math.inf
            # NaN would pass every bound check: comparisons with it are false.
            if math.isfinite(number):
                return number
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        raise ConfigError(f"{key}: expected a number, got {_describe(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {_describe(value)}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {_describe(value)}")
        return tuple(_convert(args[0], item, f"{key}[{i}]") for i, item in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {_describe(value)}")
        return dict(value)
    raise ConfigError(f"{key}: unsupported setting type {hint!r}")  # a bug in this module, not the input


def _check_bounds(f: dataclasses.Field[Any], value: object, key: str) -> None:
    meta = f.metadata
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "min" in meta and value < meta["min"]:
            raise ConfigError(f"{key}: must be at least {meta['min']}, got {value}")
        if "max" in meta and value > meta["max"]:
            raise ConfigError(f"{key}: must be at most {meta['max']}, got {value}")
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{key}: must be one of {', '.join(meta['choices'])}, got {value!r}")


def _describe(value: object) -> str:
    if value is None:
        return "nothing (null)"
    return f"{type(value).__name__} {value!r}"


def _plain(value: object) -> object:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
