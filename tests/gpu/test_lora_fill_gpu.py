"""Slot fills in parts on a CUDA GPU: a stream that waits at each part's first layer (`LoRAStacks.wait_layers`)
reads every layer of the new adapter, however late the copies run (skipped without CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.lora import LoRAStacks
from tests.unit.engine.test_lora import adapter_for
from tests.unit.engine.tiny import TINY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_layers_waited_for_read_the_fill_even_when_its_copies_run_late() -> None:
    arch = dataclasses.replace(TINY, num_layers=7)
    device = torch.device("cuda")
    stacks = LoRAStacks(arch, slots=2, max_rank=8, dtype=torch.float32, device=device, fused=True)
    modules = ("q_proj", "v_proj", "gate_proj", "down_proj")
    image = stacks.pack(adapter_for(arch, 4, 2.0, modules, seed=31))
    stacks.set_lora(1, image)  # the reference: a whole fill, waited for below
    torch.cuda.synchronize()
    assert stacks.copy_stream is not None
    with torch.cuda.stream(stacks.copy_stream):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the fill's copies run well after the reads are queued
    stacks.set_lora(0, image)
    read: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(arch.num_layers):
        stacks.wait_layers(layer)
    for group in stacks._group_a_all:
        read[group] = (stacks._group_a_all[group][:, 0].clone(), stacks._group_b_all[group][:, 0].clone())
    torch.cuda.synchronize()
    for group, (a, b) in read.items():
        torch.testing.assert_close(a, stacks._group_a_all[group][:, 1])
        torch.testing.assert_close(b, stacks._group_b_all[group][:, 1])
    assert stacks._ready[0] is None  # the step waits at its layers, not for the whole fill
