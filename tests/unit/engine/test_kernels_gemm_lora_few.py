"""The few-adapter LoRA GEMM (`engine.kernels_gemm_lora_few`) against its torch reference, interpreted on the CPU (a
child pytest with TRITON_INTERPRET=1, `test_triton_interpreted`); tests/gpu/test_gemm_lora_gpu.py runs it
compiled at real shapes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.unit.engine.interpreted import INTERPRETED, run_interpreted
from tests.unit.engine.test_kernels_gemm_lora import TOLERANCE, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
SLOTS = 5


def operands(
    rows: int, k: int, sizes: list[int], r_stack: int, dtype: torch.dtype, bias: bool
) -> dict[str, torch.Tensor]:
    """Weights for 5 slots of ranks: full, 8, 0 (a slot whose adapter leaves this group alone), full, 4. A rows and B
    columns past each slot's rank hold garbage, which the kernel must not read."""
    gen = torch.Generator().manual_seed(rows + k)
    n, slices = sum(sizes), len(sizes)
    ops = {
        "x": torch.randn(rows, k, generator=gen).to(dtype),
        "w": (torch.randn(n, k, generator=gen) / k**0.5).to(dtype),
        "a_stack": (torch.randn(SLOTS, slices * r_stack, k, generator=gen) / k**0.5).to(dtype),
        "b_stack": (torch.randn(SLOTS, r_stack, n, generator=gen) / r_stack**0.5).to(dtype).transpose(1, 2),
        "ranks": torch.tensor([r_stack, 8, 0, r_stack, 4], dtype=torch.int32),
        "scalings": torch.tensor([0.5, 2.0, 1.0, 1.5, 3.0]),
    }
    if bias:
        ops["bias"] = torch.randn(n, generator=gen).to(dtype)
    return ops


def listed_of(slots: list[int], r_stack: int) -> torch.Tensor:
    from engine.kernels_gemm_lora_few import capacity

    return torch.tensor(slots + [-1] * (capacity(r_stack) - len(slots)), dtype=torch.int32)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_capacity_keeps_the_extra_k_tile_at_128_columns() -> None:
    from engine.kernels_gemm_lora_few import capacity, fits

    assert [capacity(r) for r in (4, 8, 16, 32, 64, 128)] == [8, 8, 8, 4, 2, 1]
    assert fits([4096] * 3, 16) and fits([11008] * 2, 64) and not fits([4096], 128) and not fits([40, 8], 16)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_arguments_are_checked_before_launch() -> None:
    from engine.kernels_gemm_lora_few import SYNC_WORDS, gemm_lora_few, sync_words

    ops = operands(4, 64, [32, 16], 16, torch.float32, bias=False)
    slots = torch.tensor([0, -1, 1, 0], dtype=torch.int32)
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32)
    args = (ops["x"], ops["w"], None, ops["a_stack"], ops["b_stack"], ops["ranks"], ops["scalings"], slots)
    with pytest.raises(ValueError, match="output width"):
        gemm_lora_few(*args, listed_of([0, 1], 16), sync, slice_sizes=[16, 16])
    with pytest.raises(ValueError, match=r"listed must be int32 \[8\]"):
        gemm_lora_few(*args, torch.tensor([0, 1], dtype=torch.int32), sync, slice_sizes=[32, 16])
    with pytest.raises(ValueError, match="sync must be int32"):
        gemm_lora_few(*args, listed_of([0, 1], 16), torch.zeros(2, dtype=torch.int32), slice_sizes=[32, 16])
    with pytest.raises(ValueError, match="hx must hold 16 x 256"):
        small = torch.empty(16, 128)
        gemm_lora_few(*args, listed_of([0, 1], 16), sync, small, slice_sizes=[32, 16])
    with pytest.raises(ValueError, match="rank-major storage"):
        out_major = ops["b_stack"].contiguous()  # [S, N, R] with its rank contiguous: columns strided
        gemm_lora_few(*args[:4], out_major, *args[5:], listed_of([0, 1], 16), sync, slice_sizes=[32, 16])
    with pytest.raises(ValueError, match="call site 1024"):
        sync_words(torch.device("cpu"), 1024)
    assert sync_words(torch.device("cpu"), 3).tolist() == [0] * SYNC_WORDS


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="parent process only; needs triton")
def test_triton_interpreted() -> None:
    run_interpreted(f"{__file__}::TestInterpreted")


@pytest.mark.skipif(not INTERPRETED, reason="runs inside test_triton_interpreted's child process")
class TestInterpreted:
    """Listed adapters out of slot order, with unused entries (-1) and a slot of rank 0 among them; base rows
    beside adapter rows; one slice and three; an input width with a masked tail; one row tile, one of 128 and two;
    K split in two for the GEMM programs, or in parts for the shrink programs; stacks of rank 16 and 32."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize(
        ("rows", "k", "sizes", "r_stack", "bias"),
        [(5, 96, [64], 16, False), (7, 200, [64, 32, 32], 32, True), (70, 64, [32, 32], 16, False)],
    )
    def test_matches_torch(
        self, dtype: torch.dtype, rows: int, k: int, sizes: list[int], r_stack: int, bias: bool
    ) -> None:
        pattern = [3, -1, 1, 0, 3, 2, -1, 4]
        self.check(dtype, rows, k, sizes, r_stack, bias, [pattern[t % 8] for t in range(rows)], [4, 1, 3, 0, 2])

    @pytest.mark.parametrize("h_splits", [2, 3])
    def test_shrink_over_parts_of_k(self, h_splits: int) -> None:
        """An input width of 400 (K tiles of 128, the last masked) in 2 or 3 parts; with 3, one part is past K."""
        slots = [t % 4 - 1 for t in range(9)]
        self.check(torch.float32, 9, 400, [32, 32], 16, True, slots, [2, 0, 1], h_splits=h_splits)

    @pytest.mark.parametrize("h_splits", [1, 2])
    def test_two_row_tiles(self, h_splits: int) -> None:
        """130 rows: two tiles of 128, each with its own shrink programs (and arrival counts)."""
        slots = [t % 3 - 1 for t in range(130)]
        self.check(torch.float32, 130, 256, [32, 16], 16, True, slots, [1, 0], h_splits=h_splits)

    def test_k_split_in_two(self) -> None:
        """Where K is split, the delta is added once (by the first split), however the splits arrive."""
        self.check(torch.float32, 9, 256, [32, 32], 16, True, [0, 1, -1, 1, 0, 0, 1, -1, 0], [0, 1], split_k=2)

    def test_rows_of_an_unlisted_adapter_get_none(self) -> None:
        from engine.kernels_gemm_lora_few import SYNC_WORDS, gemm_lora_few, reference_gemm_lora_few

        ops = operands(6, 64, [32], 16, torch.float32, bias=False)
        slots = torch.tensor([0, 1, 3, 3, 1, 0], dtype=torch.int32)
        listed, sync = listed_of([0, 1], 16), torch.zeros(SYNC_WORDS, dtype=torch.int32)
        got = gemm_lora_few(**ops, token_slots=slots, listed=listed, sync=sync, bias=None, slice_sizes=[32])
        want = reference_gemm_lora_few(**ops, token_slots=slots, listed=listed, bias=None, slice_sizes=[32])
        base = ops["x"] @ ops["w"].t()
        assert rel_err(got, want) < 1e-5 and torch.allclose(got[2:4], base[2:4], atol=1e-5)
        assert not torch.allclose(got[:2], base[:2], atol=1e-2)

    @staticmethod
    def check(
        dtype: torch.dtype,
        rows: int,
        k: int,
        sizes: list[int],
        r_stack: int,
        bias: bool,
        token_slots: list[int],
        listed: list[int],
        split_k: int | None = None,
        h_splits: int | None = None,
    ) -> None:
        from engine.kernels_gemm_lora_few import SYNC_WORDS, capacity, gemm_lora_few, reference_gemm_lora_few

        ops = operands(rows, k, sizes, r_stack, dtype, bias)
        ops.setdefault("bias", None)  # type: ignore[arg-type]
        slots = torch.tensor(token_slots, dtype=torch.int32)
        entries = listed_of(listed[: capacity(r_stack)], r_stack)
        sync = torch.zeros(SYNC_WORDS, dtype=torch.int32)
        want = reference_gemm_lora_few(**ops, token_slots=slots, listed=entries, slice_sizes=sizes)
        base = torch.nn.functional.linear(ops["x"].float(), ops["w"].float())
        effect = rel_err(want, base.to(dtype))
        assert effect > 0.05, "the adapters must visibly change the output"
        for _ in range(2):  # the launch leaves its counters at zero for the next one
            got = gemm_lora_few(
                **ops,
                token_slots=slots,
                listed=entries,
                sync=sync,
                slice_sizes=sizes,
                split_k=split_k,
                h_splits=h_splits,
            )
            assert rel_err(got, want) < TOLERANCE[dtype], (rel_err(got, want), effect)
            assert sync.tolist() == [0] * SYNC_WORDS


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_shrink_splits_k_in_four_where_the_gemm_leaves_sms_free() -> None:
    """Llama-7B on 132 SMs: q/k/v (96 programs), o and down (64, K split in two) take 4 parts; gate/up (172
    programs, two an SM) one; an input width under 2048 at most one part per 1024 (SmolLM2's 576: one)."""
    from engine.kernels_gemm_lora_few import shrink_splits

    assert [shrink_splits(k, programs, 132) for k, programs in ((4096, 96), (4096, 64), (11008, 64))] == [4, 4, 4]
    assert shrink_splits(4096, 172, 132) == 1 and shrink_splits(576, 60, 132) == 1
    assert shrink_splits(1536, 36, 132) == 1 and shrink_splits(2048, 36, 132) == 2
