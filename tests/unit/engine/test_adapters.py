"""PEFT adapter validation: every malformed adapter is refused with a message saying why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.adapters import AdapterError, load_adapter, read_spec
from tests.unit.engine.tiny import TINY, write_adapter


def test_valid_adapter_loads(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "ok", rank=4, alpha=8, modules=("q_proj", "v_proj", "down_proj"))
    spec = read_spec(folder, TINY, max_rank=16)
    assert spec.rank == 4 and spec.scaling == 2.0
    assert spec.modules == {"q_proj", "v_proj", "down_proj"}
    weights = load_adapter(spec, torch.float32)
    a, b = weights.tensors[(1, "down_proj")]
    assert a.shape == (4, TINY.intermediate_size) and b.shape == (TINY.hidden_size, 4)


def test_rslora_scaling(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "rs", rank=4, alpha=8, config_overrides={"use_rslora": True})
    assert read_spec(folder, TINY, 16).scaling == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
        (lambda d: (d / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
        (lambda d: (d / "adapter_config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00garbage"), "corrupt"),
        (lambda d: _patch_config(d, use_dora=True), "use_dora"),
        (lambda d: _patch_config(d, r=0), "r must be a positive integer"),
        (lambda d: _patch_config(d, peft_type="PREFIX_TUNING"), "not LORA"),
        (lambda d: _patch_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda d: _patch_config(d, target_modules=["q_proj", "embed_tokens"]), "unsupported target modules"),
    ],
)
def test_malformed_adapters_are_refused(tmp_path: Path, mutate: object, message: str) -> None:
    folder = write_adapter(tmp_path / "bad")
    mutate(folder)  # type: ignore[operator]
    with pytest.raises(AdapterError, match=message):
        read_spec(folder, TINY, max_rank=16)


def test_wrong_base_shapes_are_refused(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "wrong", shape_override={"A": [4, 99]})
    with pytest.raises(AdapterError, match="wrong base model"):
        read_spec(folder, TINY, max_rank=16)


def test_rank_above_engine_limit(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "big", rank=32)
    with pytest.raises(AdapterError, match="max_lora_rank 16"):
        read_spec(folder, TINY, max_rank=16)


def test_nan_weights_are_refused_at_load(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = write_adapter(tmp_path / "nan")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    first = next(iter(tensors))
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="NaN"):
        load_adapter(read_spec(folder, TINY, 16), torch.float32)


def _patch_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
