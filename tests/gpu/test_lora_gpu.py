"""LoRA slot stacks on a CUDA GPU: filling and clearing a slot never makes the engine's thread wait for the GPU
(skipped without CUDA)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.adapters import AdapterSpec, load_adapter, read_spec
from engine.lora import AdapterWeights, LoRAStacks
from tests.unit.engine.test_adapter_loader import ALL7
from tests.unit.engine.tiny import TINY, write_adapter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_slot_fills_and_evictions_never_wait_for_the_gpu(tmp_path: Path) -> None:
    """A fill and an eviction used to write the slot's rank, group ranks and scaling one device value at a
    time, each copied from pageable memory and followed by a synchronisation of its stream (12 per fill and
    eviction in a profile on an H200): while serving, one waits for the work queued before it."""
    stacks = LoRAStacks(TINY, 2, 8, torch.bfloat16, torch.device("cuda"))
    assert stacks.layout is not None
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, alpha=8, modules=("q_proj", "down_proj")), TINY, 8)
    adapter = load_adapter(spec, torch.bfloat16, pin=True, layout=stacks.layout)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stacks.set_lora(1, adapter)
        stacks.reset_lora(0)
        stacks.set_lora(0, adapter)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert stacks.ranks.tolist() == [4, 4]
    group_ranks = {g: r.tolist() for g, r in stacks.group_ranks.items()}
    assert group_ranks == {"qkv": [4, 4], "o": [0, 0], "gate_up": [0, 0], "down": [4, 4]}
    assert stacks.scalings.tolist() == [2.0, 2.0]
    stacks.reset_lora(1)
    torch.cuda.synchronize()
    assert stacks.ranks.tolist() == [4, 0] and stacks.scalings.tolist() == [2.0, 0.0]


def test_a_packed_fill_turns_b_rank_major_on_the_gpu(tmp_path: Path) -> None:
    """A slot image keeps B as the file stores it ([out, rank] per member) and the fill's device copy transposes
    it: the slot must then hold, bit for bit, each member's B in its columns and zeros past the rank."""
    stacks = LoRAStacks(TINY, 2, 8, torch.bfloat16, torch.device("cuda"))
    assert stacks.layout is not None
    modules = ("q_proj", "v_proj", "gate_proj", "down_proj")
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, alpha=8, modules=modules), TINY, 8)
    loose = load_adapter(spec, torch.bfloat16, pin=False)
    packed = load_adapter(spec, torch.bfloat16, pin=True, layout=stacks.layout)
    stacks.set_lora(1, loose)  # (a fill of loose weights packs them first)
    stacks.set_lora(0, packed)
    torch.cuda.synchronize()
    for (layer, module), (a, b) in loose.tensors.items():
        torch.testing.assert_close(stacks.b[(layer, module)][0, :, :4].cpu(), b, rtol=0, atol=0)
        torch.testing.assert_close(stacks.a[(layer, module)][0, :4].cpu(), a, rtol=0, atol=0)
        assert torch.count_nonzero(stacks.b[(layer, module)][0, :, 4:]) == 0
    for group_b in stacks.group_b.values():
        torch.testing.assert_close(group_b[0], group_b[1], rtol=0, atol=0)


def test_a_layered_fill_replays_each_chunks_placement_into_the_slot_a_whole_fill_writes(tmp_path: Path) -> None:
    """Layered fills of a full-rank adapter of every group place each chunk of layers by replaying a graph
    captured when the stacks were made (`_prepare_layered`); other ranks and groups place theirs with the copies
    themselves (their padding zeroed too). A lower-rank fill, then a full-rank one over it, must each leave the
    slot as a whole fill leaves the other, bit for bit, without the engine's thread waiting for the GPU, and
    the full-rank one must make no new copies."""
    arch = dataclasses.replace(TINY, num_layers=8)  # chunks [0, 1), [1, 3), [3, 8)
    stacks = LoRAStacks(arch, 2, 8, torch.bfloat16, torch.device("cuda"), layered_fills=True)
    assert stacks.layout is not None and len(stacks._chunk_copies) == 2  # both slots, full rank, every group
    assert all(c.placement is not None for copies in stacks._chunk_copies.values() for c in copies)
    images = []
    for name, rank, modules in (("low", 4, ("k_proj", "o_proj", "up_proj")), ("full", 8, ALL7)):
        spec = read_spec(write_adapter(tmp_path / name, arch=arch, rank=rank, alpha=8, modules=modules), arch, 8)
        images.append(load_adapter(spec, torch.bfloat16, pin=True, layout=stacks.layout))
    for adapter in images:
        torch.cuda.synchronize()
        before = stacks.layered
        stacks.layered_fills = True
        torch.cuda.set_sync_debug_mode("error")
        try:
            stacks.set_lora(0, adapter)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert stacks.layered == before + 1 and len(stacks._chunk_copies) == 3  # (the low rank's made at its fill)
        torch.cuda.synchronize()
        stacks.layered_fills = False
        stacks.set_lora(1, adapter)
        torch.cuda.synchronize()
        for group_a, group_b in zip(stacks._group_a_all.values(), stacks._group_b_all.values(), strict=True):
            torch.testing.assert_close(group_a[:, 0], group_a[:, 1], rtol=0, atol=0)
            torch.testing.assert_close(group_b[:, 0], group_b[:, 1], rtol=0, atol=0)
        torch.testing.assert_close(stacks._slot_table[:, 0], stacks._slot_table[:, 1], rtol=0, atol=0)
    low = stacks._chunk_copies[(0, images[0].packed_groups, 4)]
    assert all(c.placement is None for c in low) and any(c.padding for c in low)


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_the_device_loader_gives_the_image_the_thread_loader_packs(
    file_dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read by threads into page-locked chunks, copied to the GPU a chunk at a time, placed and converted there
    and copied back: the host image must be, bit for bit, what the host packs; a non-finite value fails it. The
    copy back is held up on the device here, so that a fill from the host image must wait for it."""
    from safetensors.torch import load_file, save_file

    from engine.adapter_device_loader import DeviceLoader
    from engine.adapter_loader import ThreadLoader
    from engine.adapters import WEIGHTS_FILE, AdapterError
    from engine.pinned_arena import PinnedArena

    stacks = LoRAStacks(TINY, 2, 8, torch.bfloat16, torch.device("cuda"))
    assert stacks.layout is not None
    folder = write_adapter(tmp_path / "a", rank=4, modules=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
    path = folder / WEIGHTS_FILE
    save_file({k: v.to(file_dtype) for k, v in load_file(str(path)).items()}, str(path))
    spec = read_spec(folder, TINY, 8)
    arena = PinnedArena(4 << 20, page_bytes=4096)
    threads = ThreadLoader(torch.bfloat16, stacks.layout)
    loader = DeviceLoader(threads, torch.bfloat16, stacks.layout, torch.device("cuda"), arena, 4, 4096, 3)
    recorded, placed = DeviceLoader._record, DeviceLoader._place
    placing: list[bool] = []

    def place(self: DeviceLoader, spec: AdapterSpec, plan: Any) -> AdapterWeights:
        placing.append(True)
        try:
            return placed(self, spec, plan)
        finally:
            placing.clear()

    def copy_back_held_up(self: DeviceLoader) -> torch.cuda.Event | None:
        # Reads record events too: only `_place`'s first (`checked`) is followed by a sleep, so that the copy
        # back queues behind it.
        event = recorded(self)
        if placing and self._stream is not None:
            placing.clear()
            with torch.cuda.stream(self._stream):
                torch.cuda._sleep(200_000_000)  # (clock cycles: on the order of 0.1 s)
        return event

    monkeypatch.setattr(DeviceLoader, "_place", place)
    monkeypatch.setattr(DeviceLoader, "_record", copy_back_held_up)
    try:
        got = loader.submit(spec).result(60)
        assert got.host_ready is not None and not got.host_ready.query()  # handed over before the copy back
        # At once, while the copy back to the host may still run (`host_ready`): a fill from the host image
        # waits for it on the device, and puts in the slot what a fill from the device image puts.
        stacks.set_lora(1, dataclasses.replace(got, device_packed=None))
        stacks.set_lora(0, got)
        torch.cuda.synchronize()
        for table in (stacks._group_a_all, stacks._group_b_all):
            for weights in table.values():
                torch.testing.assert_close(weights[:, 0], weights[:, 1], rtol=0, atol=0)
        want = load_adapter(spec, torch.bfloat16, pin=True, layout=stacks.layout)
        assert got.host_ready is not None and got.host_ready.query()
        assert got.packed is not None and want.packed is not None and arena.holds(got.packed)
        torch.testing.assert_close(got.packed, want.packed, rtol=0, atol=0)
        assert got.device_packed is not None and got.device_packed.is_cuda
        torch.testing.assert_close(got.device_packed.cpu(), want.packed, rtol=0, atol=0)
        tensors = load_file(str(path))
        tensors[next(iter(tensors))][0, 0] = float("nan")
        save_file(tensors, str(path))
        with pytest.raises(AdapterError, match="NaN or infinite"):
            loader.submit(spec).result(60)
    finally:
        loader.close()
        arena.close()
