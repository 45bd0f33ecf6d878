"""`python -m engine` flags: every EngineConfig field, booleans as --flag / --no-flag."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from engine.__main__ import build_parser, config_from, main


def test_boolean_fields_are_switches_not_typed_values() -> None:
    parser = build_parser()
    assert config_from(parser.parse_args([])).enforce_eager is False
    assert config_from(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert config_from(parser.parse_args(["--enforce-eager", "--no-enforce-eager"])).enforce_eager is False


def test_typed_fields_parse_and_bad_values_are_refused() -> None:
    parser = build_parser()
    config = config_from(parser.parse_args(["--max-num-seqs", "4", "--adapter-eviction", "lru"]))
    assert config.max_num_seqs == 4 and config.adapter_eviction == "lru"
    with pytest.raises(ValueError, match="adapter_eviction"):
        config_from(parser.parse_args(["--adapter-eviction", "random"])).validate()
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "many"])


def test_gil_switch_interval_flag() -> None:
    parser = build_parser()
    assert config_from(parser.parse_args(["--gil-switch-interval-ms", "0.5"])).gil_switch_interval_ms == 0.5
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ValueError, match="gil_switch_interval_ms must be >= 0 and finite"):
            config_from(parser.parse_args(["--gil-switch-interval-ms", bad])).validate()


def test_pinned_adapter_memory_flag() -> None:
    parser = build_parser()
    assert config_from(parser.parse_args([])).pinned_adapter_memory_mb == 1024
    assert config_from(parser.parse_args(["--pinned-adapter-memory-mb", "0"])).pinned_adapter_memory_mb == 0
    with pytest.raises(ValueError, match="pinned_adapter_memory_mb"):
        config_from(parser.parse_args(["--pinned-adapter-memory-mb", "-1"])).validate()


def test_adapter_loader_workers_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    assert config_from(parser.parse_args(["--adapter-loader-workers", "3"])).loader_workers() == 3
    auto = config_from(parser.parse_args([]))
    for cores, workers in ((2, 2), (8, 4), (16, 8), (128, 8)):  # half the cores, 2 to 8
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        assert auto.loader_workers() == workers
    for bad in ("-1", "65"):  # 65 processes importing torch would only compete with the engine
        with pytest.raises(ValueError, match=r"adapter_loader_workers must be within 0\.\.64"):
            config_from(parser.parse_args(["--adapter-loader-workers", bad])).validate()


def test_adapter_loader_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    assert config_from(parser.parse_args([])).adapter_loader == "auto"
    with pytest.raises(ValueError, match="adapter_loader must be auto, thread, process or device"):
        config_from(parser.parse_args(["--adapter-loader", "gpu"])).validate()
    with pytest.raises(ValueError, match="adapter_loader device needs a CUDA device"):
        config_from(parser.parse_args(["--adapter-loader", "device", "--device", "cpu"])).validate()
    device = config_from(parser.parse_args(["--adapter-loader", "device"]))
    for cores, readers in ((2, 2), (8, 8), (16, 16), (128, 16)):  # the device loader's threads: the cores, 2 to 16
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        assert device.reader_threads() == readers
    assert config_from(parser.parse_args(["--adapter-loader-workers", "5"])).reader_threads() == 5


def test_decode_attention_flag() -> None:
    parser = build_parser()
    assert config_from(parser.parse_args([])).attention_backend == "auto"
    config_from(parser.parse_args(["--attention-backend", "torch", "--device", "cpu"])).validate()
    with pytest.raises(ValueError, match="attention_backend must be auto, triton or torch"):
        config_from(parser.parse_args(["--attention-backend", "flash"])).validate()
    with pytest.raises(ValueError, match="attention_backend triton needs a CUDA device"):
        config_from(parser.parse_args(["--attention-backend", "triton", "--device", "cpu"])).validate()


def test_async_steps_flag() -> None:
    parser = build_parser()
    assert config_from(parser.parse_args([])).async_steps == "auto"
    assert config_from(parser.parse_args(["--async-steps", "on"])).async_steps == "on"
    with pytest.raises(ValueError, match="async_steps must be auto, on or off"):
        config_from(parser.parse_args(["--async-steps", "always"])).validate()


def test_compose_late_flag() -> None:
    parser = build_parser()
    assert config_from(parser.parse_args([])).compose_late == "auto"
    assert config_from(parser.parse_args(["--compose-late", "off"])).compose_late == "off"
    assert config_from(parser.parse_args(["--compose-late", "by-kind"])).compose_late == "by-kind"
    with pytest.raises(ValueError, match="compose_late must be auto, on, by-kind or off"):
        config_from(parser.parse_args(["--compose-late", "later"])).validate()


def test_warm_up_flag() -> None:
    parser = build_parser()
    assert config_from(parser.parse_args([])).warm_up == "auto"
    assert config_from(parser.parse_args(["--warm-up", "off"])).warm_up == "off"
    with pytest.raises(ValueError, match="warm_up must be auto, on or off"):
        config_from(parser.parse_args(["--warm-up", "yes"])).validate()


def test_layered_fills_flag() -> None:
    parser = build_parser()
    assert config_from(parser.parse_args([])).layered_fills == "on"
    assert config_from(parser.parse_args(["--layered-fills", "off"])).layered_fills == "off"
    with pytest.raises(ValueError, match="layered_fills must be on or off"):
        config_from(parser.parse_args(["--layered-fills", "chunked"])).validate()


def test_fold_lora_shrinks_flag() -> None:
    parser = build_parser()
    assert config_from(parser.parse_args([])).fold_lora_shrinks == "off"
    assert config_from(parser.parse_args(["--fold-lora-shrinks", "on"])).fold_lora_shrinks == "on"
    with pytest.raises(ValueError, match="fold_lora_shrinks must be on or off"):
        config_from(parser.parse_args(["--fold-lora-shrinks", "auto"])).validate()


def test_lora_gemm_and_fills_ahead_flags() -> None:
    parser = build_parser()
    defaults = config_from(parser.parse_args([]))
    assert (defaults.lora_gemm, defaults.adapter_fills_ahead) == ("on", 2)
    flags = ["--lora-gemm", "off", "--adapter-fills-ahead", "0"]
    assert (
        config_from(parser.parse_args(flags)).lora_gemm,
        config_from(parser.parse_args(flags)).adapter_fills_ahead,
    ) == (
        "off",
        0,
    )
    assert config_from(parser.parse_args(["--lora-gemm", "single"])).lora_gemm == "single"
    with pytest.raises(ValueError, match="lora_gemm must be on, single or off"):
        config_from(parser.parse_args(["--lora-gemm", "auto"])).validate()
    with pytest.raises(ValueError, match=r"adapter_fills_ahead must be within 0\.\.64"):
        config_from(parser.parse_args(["--adapter-fills-ahead", "-1"])).validate()


def test_bad_device_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    for bad in ("gpu", "mps", "cuda:-1"):
        with pytest.raises(ValueError, match=f"device must be auto, cpu, cuda or cuda:N, got '{bad}'"):
            config_from(parser.parse_args(["--device", bad])).validate()
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    config_from(parser.parse_args(["--device", "cuda:0"])).validate()
    with pytest.raises(ValueError, match="device 'cuda:1': this machine has 1 CUDA devices"):
        config_from(parser.parse_args(["--device", "cuda:1"])).validate()
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    with pytest.raises(ValueError, match="device 'cuda': this machine has 0 CUDA devices"):
        config_from(parser.parse_args(["--device", "cuda"])).validate()


def test_engine_start_up_errors_exit_with_the_reason(tmp_path: Path) -> None:
    """A missing or unloadable model ends `python -m engine` with its reason, not a traceback."""
    with pytest.raises(SystemExit, match=r"cannot start the engine: model '.*missing': expected a \.gguf file"):
        main(["--model", str(tmp_path / "missing"), "--device", "cpu"])
    (tmp_path / "broken.gguf").write_bytes(b"not a model" * 100)
    with pytest.raises(SystemExit, match=r"cannot start the engine: broken\.gguf: not a readable GGUF file"):
        main(["--model", str(tmp_path / "broken.gguf"), "--device", "cpu"])


class _StubEngine:
    """Stands in for LLMEngine (no model): records `stop`."""

    model_name = "stub"
    stopped = False

    def __init__(self, config: object) -> None:
        pass

    def stop(self) -> None:
        _StubEngine.stopped = True


def test_a_port_in_use_exits_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    # grpcio raises RuntimeError ("Failed to bind ... set GRPC_VERBOSITY=debug") where it once returned 0: the
    # engine died with a traceback after loading its model, its loader workers left to the interpreter's exit.
    monkeypatch.setattr("engine.engine.LLMEngine", _StubEngine)
    monkeypatch.setattr(_StubEngine, "stopped", False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"cannot start the engine: cannot listen on 127\.0\.0\.1:{port} \("):
            main(["--port", str(port), "--device", "cpu"])
    assert _StubEngine.stopped
