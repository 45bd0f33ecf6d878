from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.__main__ import main, validate
from gateway.config import DEV_API_KEY, ConfigError, dump_yaml, from_dict, load_config


def test_defaults_are_the_local_dev_setup() -> None:
    config = load_config(None, environ={})
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 8080
    assert config.engines.local.count == 1
    assert config.policy.kind == "static"
    assert config.auth.anonymous_tenant is None
    assert config.tenants == ({"name": "default", "plain_api_keys": [DEV_API_KEY]},)
    validate(config)


def test_yaml_file_then_env_overrides_win(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  port: 9000\n  host: 0.0.0.0\nengines:\n  replicas: [a:1]\n")
    env = {
        "ADAPTERGATE__SERVER__PORT": "9100",
        "ADAPTERGATE__ENGINES__LOCAL__COUNT": "0",
        "ADAPTERGATE__TELEMETRY__ACCESS_LOG": "false",
        "UNRELATED": "x",
    }
    config = load_config(str(path), environ=env)
    assert config.server.port == 9100
    assert config.server.host == "0.0.0.0"
    assert config.engines.replicas == ("a:1",)
    assert config.engines.local.count == 0
    assert config.telemetry.access_log is False


def test_config_path_from_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("queue: {default_max_tokens: 64}\n")
    assert load_config(None, environ={"ADAPTERGATE_CONFIG": str(path)}).queue.default_max_tokens == 64


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"server": {"prot": 1}}, "server.prot: unknown key"),
        ({"sever": {}}, "sever: unknown key"),
        ({"server": {"port": "abc"}}, "server.port: expected an integer"),
        ({"server": {"port": 70000}}, "server.port: must be at most 65535"),
        ({"queue": {"max_total_depth": 0}}, "queue.max_total_depth: must be at least 1"),
        ({"telemetry": {"tracing": "zipkin"}}, "telemetry.tracing: must be one of off, sdk, console"),
        ({"engines": {"replicas": "a:1"}}, "engines.replicas: expected a list"),
        ({"engines": {"local": {"count": True}}}, "engines.local.count: expected an integer"),
        ({"engines": {"replicas": [1]}}, "engines.replicas[0]: expected a string"),
        ({"server": 5}, "server: expected a mapping"),
        # Once passed to the engine as they were: the engine then exited at start-up.
        ({"engines": {"local": {"max_num_seqs": 0}}}, "engines.local.max_num_seqs: must be at least 1"),
        ({"engines": {"local": {"max_model_len": -5}}}, "engines.local.max_model_len: must be at least 1"),
    ],
)
def test_bad_values_name_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(data)


def test_env_override_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=re.escape("server.max_body_bytes: expected an integer")):
        load_config(None, environ={"ADAPTERGATE__SERVER__MAX_BODY_BYTES": "lots"})
    with pytest.raises(ConfigError, match=re.escape("server.port: expected an integer")):
        load_config(None, environ={"ADAPTERGATE__SERVER__PORT__X": "1"})


def test_cross_section_checks() -> None:
    with pytest.raises(ConfigError, match=r"tenants\[0\] \(a\)\.weight"):
        validate(from_dict({"tenants": [{"name": "a", "weight": -1}]}))
    with pytest.raises(ConfigError, match=re.escape("auth.anonymous_tenant: 'ghost' is not a configured tenant")):
        validate(from_dict({"auth": {"anonymous_tenant": "ghost"}}))
    with pytest.raises(ConfigError, match=re.escape("policy.kind: unknown policy 'opa'")):
        validate(from_dict({"policy": {"kind": "opa"}}))
    with pytest.raises(ConfigError, match=re.escape("no engine configured")):
        validate(from_dict({"engines": {"local": {"count": 0}}}))


def test_float_fields_accept_integers_and_dump_round_trips() -> None:
    config = from_dict({"server": {"request_timeout_s": 5}, "engines": {"local": {"command": ["x", "y"]}}})
    assert config.server.request_timeout_s == 5.0
    import yaml

    assert from_dict(yaml.safe_load(dump_yaml(config))) == config


def test_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[3] / "config" / "adaptergate.example.yaml"
    validate(load_config(str(example), environ={}))


def test_config_command_prints_effective_config(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTERGATE__SERVER__PORT", "8181")
    monkeypatch.delenv("ADAPTERGATE_CONFIG", raising=False)
    assert main(["config"]) == 0
    assert "port: 8181" in capsys.readouterr().out


def test_config_command_reports_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTERGATE__SERVER__NOPE", "1")
    assert main(["config"]) == 2
    assert "server.nope: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"server": {1: "x", "a": "y"}}, "server.1: unknown key"),
        ({None: 1, "sever": {}}, "None: unknown key"),
        ({"server": {"request_timeout_s": 10**400}}, "server.request_timeout_s: expected a finite number"),
        ({"server": {"drain_timeout_s": float("nan")}}, "server.drain_timeout_s: expected a finite number"),
        ({"engines": {"poll_interval_s": float("inf")}}, "engines.poll_interval_s: expected a finite number"),
        # Beyond what a gRPC deadline can hold: every engine call would fail at once with DEADLINE_EXCEEDED.
        ({"server": {"request_timeout_s": 1e10}}, "server.request_timeout_s: must be at most"),
        ({"engines": {"rpc_timeout_s": 1e12}}, "engines.rpc_timeout_s: must be at most"),
    ],
)
def test_odd_keys_and_numbers_name_the_key(data: dict[object, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(data)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfeserver: {port: 1}\n", "not UTF-8 text"),
        (b"server: " + b"[" * 5000 + b"]" * 5000, "invalid YAML: nested too deeply"),
        (b"server: {port: " + b"9" * 5000 + b"}\n", "invalid YAML"),
    ],
)
def test_unreadable_config_files_are_config_errors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(f"config file {path}: {message}")):
        load_config(str(path), environ={})


def test_env_override_with_a_huge_integer_names_the_key() -> None:
    with pytest.raises(ConfigError, match=re.escape("server.port: expected an integer")):
        load_config(None, environ={"ADAPTERGATE__SERVER__PORT": "9" * 5000})


@pytest.mark.parametrize("digest", ["sha256:" + "AB" * 32, "sha256:" + "é" * 64, "sha256:" + "g" * 64])
def test_admin_key_digests_must_be_what_hash_api_key_makes(digest: str) -> None:
    # Upper-case hex would never match a presented key; non-ASCII crashed the start when the admin API was built.
    with pytest.raises(ConfigError, match=re.escape("auth.admin_api_keys[0]: must be 'sha256:' + 64 lowercase hex")):
        validate(from_dict({"auth": {"admin_api_keys": [digest]}}))


def test_adaptergate_engine_names_itself_in_usage_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    # It ran the engine module as `python -m engine`, whose name its usage and errors then showed.
    with pytest.raises(SystemExit) as exit_:
        main(["engine", "--port", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: adaptergate engine ") and "adaptergate engine: error: argument --port" in err
