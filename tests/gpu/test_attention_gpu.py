"""The compiled decode attention kernels on a CUDA GPU against the torch path (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode_step import (
    SHAPES,
    assert_as_accurate_as_torch,
    compare_decode_step,
    compare_prefill,
    replay_with_new_positions,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("max_len", [256, 4096])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decode_step_matches_the_torch_path(shape: str, max_len: int, dtype: torch.dtype) -> None:
    """In fp32 the two paths agree to rounding; in bf16 the kernels' error against fp32 is the torch path's."""
    assert_as_accurate_as_torch(compare_decode_step(shape, max_len, dtype, torch.device("cuda")), dtype)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_graph_replays_other_slots_and_positions(shape: str) -> None:
    assert replay_with_new_positions(shape, 1024, torch.bfloat16) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_prefill_matches_the_torch_path(shape: str, dtype: torch.dtype) -> None:
    assert_as_accurate_as_torch(compare_prefill(shape, 300, dtype, torch.device("cuda")), dtype)
