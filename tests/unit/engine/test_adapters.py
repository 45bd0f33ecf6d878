"""PEFT adapter validation: every malformed adapter is refused with a message saying why."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from engine.adapter_loader import layer_parts
from engine.adapters import WEIGHTS_FILE, AdapterError, AdapterSpec, load_adapter, load_layers_into, read_spec
from engine.lora import LoRAStacks, SlotLayout, image_groups
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


def _image(layout: SlotLayout, spec: AdapterSpec, dtype: torch.dtype) -> torch.Tensor:
    """An empty slot image for `spec`, filled with NaN so that any element left unwritten shows."""
    return torch.full((layout.image_size(image_groups(spec.modules), spec.rank),), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layers_loaded_part_by_part_make_the_image_a_whole_load_makes(dtype: torch.dtype, tmp_path: Path) -> None:
    """Loader processes fill one image side by side, a range of layers each: together they must write every
    element of it, members the adapter lacks (k_proj here) as zeros, exactly as one whole load."""
    layout = LoRAStacks(TINY, 1, 8, dtype, torch.device("cpu"), fused=True).layout
    assert layout is not None
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=("q_proj", "v_proj", "down_proj")), TINY, 8)
    whole = load_adapter(spec, dtype, pin=False, layout=layout).packed
    assert whole is not None
    image = _image(layout, spec, dtype)
    for layers in layer_parts(TINY.num_layers, 2):
        load_layers_into(spec, dtype, layout, image, layers)
    torch.testing.assert_close(image, whole, rtol=0, atol=0)


def test_layer_parts_cover_every_layer_once() -> None:
    assert layer_parts(30, 4) == [range(0, 7), range(7, 15), range(15, 22), range(22, 30)]
    assert layer_parts(2, 8) == [range(0, 1), range(1, 2)]  # never an empty part
    assert layer_parts(5, 1) == [range(0, 5)]


def test_a_part_refuses_non_finite_weights_in_its_own_layers_only(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    layout = LoRAStacks(TINY, 1, 8, torch.float32, torch.device("cpu"), fused=True).layout
    assert layout is not None
    folder = write_adapter(tmp_path / "bad")
    path = str(folder / "adapter_model.safetensors")
    tensors = load_file(path)
    tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"][0, 3] = float("inf")
    save_file(tensors, path)
    spec = read_spec(folder, TINY, 8)
    image = _image(layout, spec, torch.float32)
    load_layers_into(spec, torch.float32, layout, image, range(0, 1))
    with pytest.raises(AdapterError, match="v_proj of layer 1 contains NaN or infinite"):
        load_layers_into(spec, torch.float32, layout, image, range(1, 2))


def test_a_part_refuses_a_file_changed_since_registration(tmp_path: Path) -> None:
    """The image was sized for the registered modules and rank: a replaced file must not be packed into it."""
    layout = LoRAStacks(TINY, 1, 8, torch.float32, torch.device("cpu"), fused=True).layout
    assert layout is not None
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=("q_proj",)), TINY, 8)
    image = _image(layout, spec, torch.float32)
    write_adapter(tmp_path / "a", rank=4, modules=("q_proj", "o_proj"))
    with pytest.raises(AdapterError, match=r"changed since it was registered \(now has \['o_proj'\]\)"):
        load_layers_into(spec, torch.float32, layout, image, range(0, 2))
    write_adapter(tmp_path / "a", rank=8, modules=("q_proj",))
    with pytest.raises(AdapterError, match=r"q_proj of layer [01] is not of rank 4"):
        load_layers_into(spec, torch.float32, layout, image, range(0, 2))
    write_adapter(tmp_path / "a", rank=4, modules=("q_proj",), shape_override={"A": [4, 99]})
    with pytest.raises(AdapterError, match="no longer fits its registered shapes"):
        load_layers_into(spec, torch.float32, layout, image, range(0, 2))
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(AdapterError, match=r"cannot load adapter_model\.safetensors"):
        load_layers_into(spec, torch.float32, layout, image, range(0, 2))


def test_weights_that_are_not_floating_point_are_refused_at_registration(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = write_adapter(tmp_path / "ints")
    path = str(folder / "adapter_model.safetensors")
    tensors = load_file(path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, path)
    with pytest.raises(AdapterError, match=rf"'{re.escape(key)}' holds I32, not floating-point weights"):
        read_spec(folder, TINY, 16)


def _write_safetensors_by_hand(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file with the tensors in the given order, unpadded: the library's writer orders them so
    that each lies aligned, which the format does not require of other writers."""
    names = {torch.float16: "F16", torch.float32: "F32"}
    header: dict[str, object] = {}
    blobs, offset = [], 0
    for name, tensor in tensors.items():
        blob = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + b"".join(blobs))


def test_a_part_reads_tensors_the_file_stores_unaligned(tmp_path: Path) -> None:
    """An fp16 tensor of an odd length puts the fp32 tensor after it off its 4-byte alignment in the mapped file."""
    odd = dataclasses.replace(TINY, hidden_size=33)
    folder = write_adapter(tmp_path / "odd", arch=odd, rank=3, modules=("q_proj",))
    path = folder / "adapter_model.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    ordered = {name: t.half() if "lora_A" in name else t for name, t in sorted(tensors.items())}
    _write_safetensors_by_hand(path, ordered)
    layout = LoRAStacks(odd, 1, 4, torch.float32, torch.device("cpu"), fused=True).layout
    assert layout is not None
    spec = read_spec(folder, odd, 4)
    whole = load_adapter(spec, torch.float32, pin=False, layout=layout).packed
    assert whole is not None
    image = _image(layout, spec, torch.float32)
    load_layers_into(spec, torch.float32, layout, image, range(0, odd.num_layers))
    torch.testing.assert_close(image, whole, rtol=0, atol=0)


def test_a_part_refuses_a_file_replaced_while_it_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is mapped through the handle its header was read by; a path that names another file by then
    (an adapter directory updated in place) is refused rather than mixed."""
    import engine.adapters as adapters

    layout = LoRAStacks(TINY, 1, 8, torch.float32, torch.device("cpu"), fused=True).layout
    assert layout is not None
    spec = read_spec(write_adapter(tmp_path / "a", rank=4), TINY, 8)
    real_stat = os.stat

    def replaced(path: object) -> os.stat_result:
        fields = list(real_stat(path))  # type: ignore[arg-type]
        fields[1] += 1  # another inode
        return os.stat_result(fields)

    monkeypatch.setattr(adapters.os, "stat", replaced)
    with pytest.raises(AdapterError, match="was replaced while it loaded"):
        load_layers_into(spec, torch.float32, layout, _image(layout, spec, torch.float32), range(0, 2))


@pytest.mark.parametrize("alpha", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_lora_alpha_is_refused(alpha: float, tmp_path: Path) -> None:
    """Python's JSON reads NaN and Infinity: such a scaling would turn every output of the adapter into NaN."""
    folder = write_adapter(tmp_path / "a", config_overrides={"lora_alpha": alpha})
    with pytest.raises(AdapterError, match="lora_alpha must be a finite number"):
        read_spec(folder, TINY, 16)


@pytest.mark.parametrize("packed", [False, True], ids=["loose", "packed"])
@pytest.mark.parametrize(
    ("rank", "modules", "message"),
    [
        (1, ("q_proj", "v_proj"), r"[qv]_proj of layer [01] is not of rank 4"),  # would broadcast into rank 4
        (2, ("q_proj", "v_proj"), r"[qv]_proj of layer [01] is not of rank 4"),
        (4, ("k_proj",), r"changed since it was registered \(now has \['k_proj'\]\)"),
    ],
    ids=["rank-1", "rank-2", "modules"],
)
def test_a_whole_load_refuses_a_file_changed_since_registration(
    packed: bool, rank: int, modules: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    """A file rewritten after its check (a reload after the host tier dropped it) must not be served on the
    registered spec: its weights were broadcast into the registered rank, loaded into a slot under the wrong
    projections, or failed the engine's step when copied into a slot."""
    layout = LoRAStacks(TINY, 1, 8, torch.float32, torch.device("cpu"), fused=True).layout if packed else None
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=("q_proj", "v_proj")), TINY, 8)
    write_adapter(tmp_path / "a", rank=rank, modules=modules, seed=1)
    with pytest.raises(AdapterError, match=message):
        load_adapter(spec, torch.float32, pin=False, layout=layout)


def test_a_part_refuses_a_file_whose_rank_changed_since_registration(tmp_path: Path) -> None:
    """A rank-1 file fits the registered rank-4 image by broadcasting: each of its rows would be copied 4 times."""
    layout = LoRAStacks(TINY, 1, 8, torch.float32, torch.device("cpu"), fused=True).layout
    assert layout is not None
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=("q_proj",)), TINY, 8)
    write_adapter(tmp_path / "a", rank=1, modules=("q_proj",))
    with pytest.raises(AdapterError, match=r"q_proj of layer [01] is not of rank 4"):
        load_layers_into(spec, torch.float32, layout, _image(layout, spec, torch.float32), range(0, 2))


def _with_a_repeat(folder: Path) -> str:
    """Store one tensor a second time under another prefix the key pattern accepts; its new name."""
    from safetensors.torch import load_file, save_file

    path = folder / WEIGHTS_FILE
    tensors = load_file(str(path))
    name = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    repeat = name.removeprefix("base_model.model.")
    save_file({**tensors, repeat: tensors[name].clone()}, str(path))
    return repeat


@pytest.mark.parametrize("packed", [False, True])
def test_a_tensor_stored_twice_is_refused_naming_both(packed: bool, tmp_path: Path) -> None:
    """Which copy a loader kept was arbitrary, and the device loader read the repeats into GPU memory the KV
    cache left no room for. At registration, and at a load of a file rewritten so since its check."""
    folder = write_adapter(tmp_path / "a", rank=4, modules=("q_proj", "v_proj"))
    spec = read_spec(folder, TINY, 8)
    repeat = _with_a_repeat(folder)
    with pytest.raises(AdapterError, match=re.escape(f"{repeat!r} repeats")):
        read_spec(folder, TINY, 8)
    layout = LoRAStacks(TINY, 1, 8, torch.float32, torch.device("cpu"), fused=True).layout if packed else None
    with pytest.raises(AdapterError, match=r"repeats .* \(layer 0 q_proj lora_A\)"):
        load_adapter(spec, torch.float32, pin=False, layout=layout)
