"""The batched LoRA path against the per-token torch reference of engine.kernels."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.lora import AdapterWeights, LoRAStacks
from engine.lora_batch import LoRABatch
from tests.unit.engine.tiny import TINY


def random_adapter(rank: int, scaling: float, modules: tuple[str, ...], seed: int) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(TINY.num_layers):
        for module in modules:
            fan_in, fan_out = TINY.projection_shapes()[module]
            tensors[(layer, module)] = (
                torch.randn(rank, fan_in, generator=gen),
                torch.randn(fan_out, rank, generator=gen),
            )
    return AdapterWeights(rank=rank, scaling=scaling, modules=frozenset(modules), tensors=tensors)


@pytest.fixture
def stacks() -> LoRAStacks:
    s = LoRAStacks(TINY, slots=4, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    s.set_lora(0, random_adapter(2, 2.0, ("q_proj", "v_proj"), seed=1))
    s.set_lora(1, random_adapter(8, 0.5, ("q_proj", "k_proj", "down_proj"), seed=2))
    s.set_lora(3, random_adapter(4, 1.0, ("q_proj",), seed=3))
    return s


@pytest.mark.parametrize(
    "token_slots",
    [
        [0, 0, 0, 0],  # one adapter, contiguous
        [-1, 0, 1, -1, 3, 1, 0],  # mixed, interleaved, base rows
        [1, 1, 1, 3, 3, 0, 0, 0, -1, -1],  # prefill-like segments of different ranks
        [-1, -1],  # base only
        [0] * 40 + [1] * 30 + [-1] * 5 + [3] * 2,  # long prefill: the grouped (per-adapter) path
    ],
)
@pytest.mark.parametrize("module", ["q_proj", "k_proj", "v_proj", "down_proj"])
def test_batch_matches_reference(stacks: LoRAStacks, token_slots: list[int], module: str) -> None:
    fan_in, fan_out = TINY.projection_shapes()[module]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(len(token_slots), fan_in, generator=gen)
    y0 = torch.randn(len(token_slots), fan_out, generator=gen)
    slots = torch.tensor(token_slots, dtype=torch.int32)
    a, b = stacks.a[(1, module)], stacks.b[(1, module)]

    expected = y0.clone()
    h = kernels.lora_shrink_reference(x, a, stacks.ranks, slots)
    kernels.lora_expand_reference(expected, h, b, stacks.ranks, stacks.scalings, slots)

    got = y0.clone()
    batch = LoRABatch.build(stacks, token_slots, torch.device("cpu"))
    if batch is not None:
        batch.apply(1, module, x, got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_set_and_reset_lora(stacks: LoRAStacks) -> None:
    assert stacks.slot_ranks[1] == 8
    stacks.reset_lora(1)
    assert stacks.slot_ranks[1] == 0 and int(stacks.ranks[1]) == 0
    assert torch.count_nonzero(stacks.a[(0, "k_proj")][1]) == 0
    # Slot 0 is untouched by resetting slot 1.
    assert torch.count_nonzero(stacks.a[(0, "q_proj")][0]) > 0


def test_rank_above_max_is_refused(stacks: LoRAStacks) -> None:
    with pytest.raises(ValueError, match="max_lora_rank"):
        stacks.set_lora(2, random_adapter(16, 1.0, ("q_proj",), seed=4))


def test_cpu_decode_uses_the_dense_path_and_prefill_the_grouped_one(stacks: LoRAStacks) -> None:
    decode = LoRABatch.build(stacks, [0, 1, 3, -1], torch.device("cpu"))
    prefill = LoRABatch.build(stacks, [0] * 60 + [1] * 60, torch.device("cpu"))
    assert decode is not None and decode.dense_mask is not None
    assert prefill is not None and prefill.dense_mask is None


def test_pure_base_step_has_no_lora_batch(stacks: LoRAStacks) -> None:
    assert LoRABatch.build(stacks, [-1, -1, -1], torch.device("cpu")) is None


def test_replacing_an_adapter_leaves_nothing_of_the_old_one(stacks: LoRAStacks) -> None:
    # Slot 1 held rank 8 on q/k/down; a rank-2 adapter on q only must not inherit rows or modules from it.
    stacks.set_lora(1, random_adapter(2, 1.0, ("q_proj",), seed=9))
    for layer in range(TINY.num_layers):
        assert torch.count_nonzero(stacks.a[(layer, "q_proj")][1, 2:]) == 0
        assert torch.count_nonzero(stacks.b[(layer, "q_proj")][1, :, 2:]) == 0
        assert torch.count_nonzero(stacks.bt[(layer, "q_proj")][1 * 8 + 2 : 2 * 8]) == 0
        for module in ("k_proj", "down_proj"):
            assert torch.count_nonzero(stacks.a[(layer, module)][1]) == 0
            assert torch.count_nonzero(stacks.b[(layer, module)][1]) == 0
    assert stacks.slot_ranks[1] == 2 and stacks.slot_modules[1] == {"q_proj"}


def test_packed_adapters_fill_fused_stacks_like_loose_copies() -> None:
    """Fused stacks (the CUDA layout, here on the CPU) filled from packed slot images hold exactly what
    per-projection copies write, replacements included, and zero group ranks where an adapter is absent."""
    fused = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    loose = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    # The second replaces the first in slot 1 at a lower rank: the padding past rank 4 must be zeroed.
    first = random_adapter(8, 1.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"), seed=4)
    second = random_adapter(4, 2.0, ("k_proj", "gate_proj"), seed=5)
    for adapter in (first, second):
        packed = fused.pack(adapter)
        assert packed.packed is not None and not packed.tensors
        assert fused.layout is not None  # images hold the adapter's rank, not the stack's max rank
        assert packed.packed.numel() == fused.layout.image_size(packed.packed_groups, adapter.rank)
        fused.set_lora(1, packed)
        loose.set_lora(1, adapter)
    for layer in range(TINY.num_layers):
        for module in ("k_proj", "gate_proj", "up_proj"):  # the groups slot 1 uses now
            torch.testing.assert_close(fused.a[(layer, module)][1], loose.a[(layer, module)][1])
            torch.testing.assert_close(fused.b[(layer, module)][1], loose.b[(layer, module)][1])
    ranks = {g: int(r[1]) for g, r in fused.group_ranks.items()}
    assert ranks == {"qkv": 4, "o": 0, "gate_up": 4, "down": 0}  # o and down hold stale weights: skipped
    x = torch.randn(3, TINY.hidden_size)
    y_fused = torch.zeros(3, 2 * TINY.intermediate_size)
    y_loose = torch.zeros(3, 2 * TINY.intermediate_size)
    for stacks, y in ((fused, y_fused), (loose, y_loose)):
        batch = LoRABatch.build(stacks, [1, -1, 1], torch.device("cpu"))
        assert batch is not None
        batch.apply_group(0, "gate_up", x, y)
    torch.testing.assert_close(y_fused, y_loose)
    assert y_fused[1].abs().sum() == 0 and y_fused[0].abs().sum() > 0


def test_fused_stacks_store_b_rank_major_and_images_out_major() -> None:
    """Fused stacks keep B as [slots, max_rank, out] storage behind [slots, out, max_rank] views (N contiguous,
    what the expand kernel reads row by row up to each rank); a slot image's B is [layers, out, rank], each
    member's B as the file has it (packed without a transposed copy), and the fill transposes it."""
    fused = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    adapter = random_adapter(4, 1.0, ("q_proj", "v_proj"), seed=8)
    packed = fused.pack(adapter)
    assert fused.layout is not None and packed.packed is not None and packed.packed_groups == ("qkv",)
    ((_, b_img),) = fused.layout.images(packed.packed, packed.packed_groups, 4)
    widths = fused.group_slices["qkv"]
    assert b_img.shape == (TINY.num_layers, sum(widths), 4) and b_img.stride()[1:] == (4, 1)  # each layer's B out-major
    fused.set_lora(1, packed)
    for layer in range(TINY.num_layers):
        group_b = fused.group_b[(layer, "qkv")]
        assert group_b.shape == (2, sum(widths), 8) and group_b.stride(1) == 1
        torch.testing.assert_close(b_img[layer, : widths[0]], adapter.tensors[(layer, "q_proj")][1])
        torch.testing.assert_close(fused.b[(layer, "q_proj")][1, :, :4], adapter.tensors[(layer, "q_proj")][1])
        assert torch.count_nonzero(fused.b[(layer, "k_proj")][1]) == 0  # absent member: zero in the image
        assert torch.count_nonzero(group_b[1, :, 4:]) == 0


def test_fused_slot_reset_then_refilled_from_loose_weights_holds_only_the_new_adapter() -> None:
    """Resetting a fused slot leaves its weights behind (group ranks of 0 hide them); a later fill, even
    from loose (unpacked) weights of a lower rank and fewer projections, must then leave nothing of them
    where the kernels read."""
    fused = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    loose = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    old = random_adapter(8, 1.0, ("q_proj", "k_proj", "v_proj", "gate_proj"), seed=6)
    new = random_adapter(2, 3.0, ("k_proj",), seed=7)
    for stacks in (fused, loose):
        stacks.set_lora(0, stacks.pack(old))
        stacks.reset_lora(0)
        assert stacks.slot_ranks[0] == 0 and all(int(r[0]) == 0 for r in stacks.group_ranks.values())
        stacks.set_lora(0, new)  # loose weights: fused stacks pack them first
    assert {g: int(r[0]) for g, r in fused.group_ranks.items()} == {"qkv": 2, "o": 0, "gate_up": 0, "down": 0}
    for layer in range(TINY.num_layers):
        for module in ("q_proj", "k_proj", "v_proj"):
            torch.testing.assert_close(fused.a[(layer, module)][0], loose.a[(layer, module)][0])
            torch.testing.assert_close(fused.b[(layer, module)][0], loose.b[(layer, module)][0])


def test_fused_fills_that_reuse_a_slots_views_write_each_adapter_whole() -> None:
    """A slot's destination views are made once per (slot, groups, rank) and reused by later fills: a second
    fill through them must overwrite everything the first wrote, and another slot's fill must not touch it."""
    fused = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    modules = ("q_proj", "v_proj", "down_proj")
    x, y = random_adapter(4, 1.5, modules, seed=11), random_adapter(4, 2.5, modules, seed=12)
    fused.set_lora(0, fused.pack(x))
    fused.set_lora(1, fused.pack(y))
    fused.set_lora(0, fused.pack(y))
    for layer in range(TINY.num_layers):
        for module in modules:
            torch.testing.assert_close(fused.a[(layer, module)][0], fused.a[(layer, module)][1])
            torch.testing.assert_close(fused.b[(layer, module)][0, :, :4], y.tensors[(layer, module)][1])
    assert fused.scalings.tolist() == [2.5, 2.5] and fused.ranks.tolist() == [4, 4]
