"""bench/loader_parts.py: its preadv variant writes the engine's image, in the file's dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.loader_parts import read_into
from engine.adapters import load_adapter, read_spec
from engine.lora import LoRAStacks, image_groups
from tests.unit.engine.tiny import TINY, write_adapter

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("modules", [ALL7, ("q_proj", "v_proj", "down_proj")], ids=["all", "some"])
def test_each_tensor_read_into_its_place_gives_the_packed_image(tmp_path: Path, modules: tuple[str, ...]) -> None:
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=modules, seed=3), TINY, 8)
    layout = LoRAStacks(TINY, 1, 8, torch.float32, torch.device("cpu"), fused=True).layout
    assert layout is not None
    expected = load_adapter(spec, torch.float32, pin=False, layout=layout).packed
    assert expected is not None
    # Members an adapter leaves out are zeros in the packed image; the reader writes only the file's tensors.
    image = torch.zeros_like(expected)
    for layers in (range(0, 1), range(1, 2)):  # two parts, as two loader processes would
        read_into(spec, layout, image, layers, check="checked after")
    assert torch.equal(image, expected)


def test_a_file_with_an_infinity_fails_the_check(tmp_path: Path) -> None:
    from tests.unit.engine.test_pool import _poison

    folder = _poison(write_adapter(tmp_path / "a", rank=4, seed=3), float("inf"))
    spec = read_spec(folder, TINY, 8)
    layout = LoRAStacks(TINY, 1, 8, torch.float32, torch.device("cpu"), fused=True).layout
    assert layout is not None
    image = torch.zeros(layout.image_size(image_groups(spec.modules), 4))
    with pytest.raises(ValueError, match="not finite"):
        read_into(spec, layout, image, range(TINY.num_layers), check="checked after")
