"""Corrupt or truncated model files are refused with an error naming the file, not a library's bare message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.loader import load_weights, resolve_model
from tests.unit.engine.test_loader_gguf import write_tiny_gguf


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTERGATE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("damage", ["truncated", "not_gguf"])
def test_unreadable_gguf_is_refused_by_name(damage: str, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4] if damage == "truncated" else b"not a model" * 100)
    with pytest.raises(ValueError, match=r"tiny\.gguf: not a readable GGUF file"):
        load_weights(resolve_model(str(path)))


def _hf_folder(folder: Path) -> Path:
    folder.mkdir()
    config = dict(
        model_type="llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, str(folder / "model.safetensors"))
    return folder


def test_truncated_safetensors_is_refused_by_name(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "model")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_weights(resolve_model(str(folder)))


def test_broken_config_json_is_refused_by_name(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "model")
    (folder / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_weights(resolve_model(str(folder)))
