"""PEFT adapter validation: every malformed adapter is refused with a message saying why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.adapters import AdapterError, load_adapter, read_spec
from engine.lora import LoRAStacks
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


@pytest.mark.parametrize("packed", [False, True], ids=["loose", "packed"])
@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        (float("nan"), torch.float32),
        (float("inf"), torch.float32),
        (-float("inf"), torch.bfloat16),
        (1e6, torch.float16),
    ],
    ids=["nan", "inf", "-inf", "overflows-fp16"],
)
def test_non_finite_weights_are_refused_at_load(value: float, dtype: torch.dtype, packed: bool, tmp_path: Path) -> None:
    """Loose or packed into the slot layout, a NaN, an infinity, or a value past the engine dtype's range
    (finite in the fp32 file) is refused, naming the projection and layer."""
    from safetensors.torch import load_file, save_file

    folder = write_adapter(tmp_path / "bad", modules=("q_proj", "v_proj"))
    path = str(folder / "adapter_model.safetensors")
    tensors = load_file(path)
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[name][2, 1] = value
    save_file(tensors, path)
    layout = LoRAStacks(TINY, 1, 8, dtype, torch.device("cpu"), fused=True).layout if packed else None
    with pytest.raises(AdapterError, match="v_proj of layer 1 contains NaN or infinite"):
        load_adapter(read_spec(folder, TINY, 16), dtype, pin=False, layout=layout)
    tensors[name][2, 1] = 0.5  # the same file, repaired, loads
    save_file(tensors, path)
    assert load_adapter(read_spec(folder, TINY, 16), dtype, pin=False, layout=layout).rank == 4


def _patch_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_a_weights_file_truncated_after_registration_fails_its_load_only(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "cut")
    spec = read_spec(folder, TINY, 16)
    path = folder / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(AdapterError, match=r"cannot load adapter_model\.safetensors"):
        load_adapter(spec, torch.float32, pin=False)
