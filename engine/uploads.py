"""Host values onto the device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(
    values: Sequence[int] | Sequence[float] | Sequence[tuple[int, ...]], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """`values` on `device`, copied without a stream sync: from pageable memory CUDA stages the copy at once,
    where a blocking copy (`torch.tensor(values, device=...)`) would first wait for the work queued on the
    device (the step's forward pass), and an engine stepping ahead would lose its overlap."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
