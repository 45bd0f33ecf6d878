"""Decode projections with their LoRA inside the GEMM (`engine.kernels_gemm_lora`) against the torch reference,
interpreted on the CPU (a child pytest with TRITON_INTERPRET=1, `test_triton_interpreted`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.unit.engine.interpreted import INTERPRETED, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def operands(
    rows: int, k: int, sizes: list[int], r_stack: int, dtype: torch.dtype, bias: bool, seed: int = 0
) -> dict[str, torch.Tensor | None]:
    """Weights and 3 slots (ranks: full, 8, 0) whose A rows and B columns past each slot's rank are garbage (slot
    2 is all garbage): the kernel must not read them (the engine's stacks hold zeros or stale weights there)."""
    gen = torch.Generator().manual_seed(seed)
    n, slices = sum(sizes), len(sizes)
    b_store = torch.randn(3, r_stack, n, generator=gen) / r_stack**0.5  # rank-major, as the engine stores B
    return {
        "x": torch.randn(rows, k, generator=gen).to(dtype),
        "w": (torch.randn(n, k, generator=gen) / k**0.5).to(dtype),
        "bias": torch.randn(n, generator=gen).to(dtype) if bias else None,
        "a_stack": (torch.randn(3, slices * r_stack, k, generator=gen) / k**0.5).to(dtype),
        "b_stack": b_store.to(dtype).transpose(1, 2),
        "ranks": torch.tensor([r_stack, 8, 0], dtype=torch.int32),
        "scalings": torch.tensor([0.5, 2.0, 1.0]),
    }


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_shapes_are_checked_before_launch() -> None:
    from engine.kernels_gemm_lora import block_n_for, fits, gemm_lora

    ops = operands(4, 64, [32, 16], 16, torch.float32, bias=False)
    slots = torch.tensor([0, -1, 0, 0], dtype=torch.int32)
    args = (ops["x"], ops["w"], None, ops["a_stack"], ops["b_stack"], ops["ranks"], ops["scalings"], slots)
    with pytest.raises(ValueError, match="output width"):
        gemm_lora(*args, slice_sizes=[16, 16])
    with pytest.raises(ValueError, match="L\\*R rows"):
        gemm_lora(*args[:3], ops["a_stack"][:, :24], *args[4:], slice_sizes=[32, 16])  # type: ignore[arg-type]
    assert fits([4096] * 3, 64) and not fits([4096] * 3, 128)  # ranks past 64 keep the separate kernels
    with pytest.raises(ValueError, match="rank > 64"):
        big = torch.zeros(3, 2 * 128, 64)
        gemm_lora(
            ops["x"], ops["w"], None, big, torch.zeros(3, 128, 48).transpose(1, 2), *args[5:], slice_sizes=[32, 16]
        )  # type: ignore[arg-type]
    assert block_n_for([4096] * 3, 12288) == 128 and block_n_for([11008, 11008], 22016) == 128
    assert block_n_for([4096], 4096) == 32 and block_n_for([4096, 1024, 1024], 6144) == 64
    assert block_n_for([576, 192, 192], 960) == 16 and block_n_for([40, 8], 48) is None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_tiling_splits_k_where_wide_tiles_are_too_few() -> None:
    """q/k/v and gate/up keep 128-column tiles unsplit; o and down (4096 outputs) take 64-column tiles with K split
    in two rather than 32-column tiles; SmolLM2's inputs (576) are too short to split, its widths stay narrow."""
    from engine.kernels_gemm_lora import tiling

    assert tiling([4096] * 3, 12288, 4096) == (128, 1) and tiling([11008] * 2, 22016, 4096) == (128, 1)
    assert tiling([4096], 4096, 4096) == (64, 2) and tiling([4096], 4096, 11008) == (64, 2)
    assert tiling([576, 192, 192], 960, 576) == (16, 1) and tiling([1536, 1536], 3072, 576) == (32, 1)
    assert tiling([576], 576, 1536) == (16, 1) and tiling([40, 8], 48, 64) is None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_rows_past_a_decode_batch_of_64_take_one_row_tile() -> None:
    """65-128 rows (64 decode rows and a joiner's) in one tile of 128 on 8 warps, not two tiles of 64: each column
    tile's weight is then streamed once. Past 128, tiles of 128."""
    from engine.kernels_gemm_lora import gemm_lora, row_tile

    assert row_tile(1) == (16, 4) and row_tile(64) == (64, 4)
    assert row_tile(65) == row_tile(72) == row_tile(128) == (128, 8) and row_tile(300) == (128, 8)
    ops = operands(4, 64, [32, 16], 16, torch.float32, bias=False)
    slots = torch.zeros(4, dtype=torch.int32)
    args = (ops["x"], ops["w"], None, ops["a_stack"], ops["b_stack"], ops["ranks"], ops["scalings"], slots)
    with pytest.raises(ValueError, match="block_m 48"):
        gemm_lora(*args, slice_sizes=[32, 16], block_m=48)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_k 48"):
        gemm_lora(*args, slice_sizes=[32, 16], block_k=48)  # type: ignore[arg-type]


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="compiled launch shapes (parent process); needs triton")
def test_pipeline_fits_the_gpus_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """K tile and stages from the shared memory each resident program gets: a pipeline sized for an H200 does not
    compile where a block has 99 KiB (A10 and other pre-Hopper GPUs)."""
    from engine import kernels_gemm_lora as kg
    from engine import kernels_triton

    x = torch.zeros(64, 8, dtype=torch.bfloat16)
    rows = 64 + 128 + 16  # x, weight and A tiles of a 128-column program
    monkeypatch.setattr(kernels_triton, "_sm_count", lambda device: 132)
    monkeypatch.setattr(kg, "_shared_memory", lambda device: 220 * 1024)  # an H200's
    assert kg._pipeline(x, 96, rows) == (128, 4)  # q/k/v: a program an SM
    assert kg._pipeline(x, 172, rows) == (64, 4)  # gate/up: two share an SM
    # The 128-row tile: 4 stages of BLOCK_K 128 do not fit, so 6 of 64 (q/k/v), 3 where two share an SM (gate/up).
    tall = 128 + 128 + 16
    assert kg._pipeline(x, 96, tall) == (64, 6)
    assert kg._pipeline(x, 172, tall) == (64, 3)
    assert kg._pipeline(x, 128, 128 + 64 + 16) == (128, 4)  # o and down: 64-column tiles, K split in two
    monkeypatch.setattr(kg, "_shared_memory", lambda device: 92 * 1024)
    for tiles in (96, 172):
        block_k, stages = kg._pipeline(x, tiles, rows)
        assert stages >= 2 and stages * rows * block_k * 2 <= 92 * 1024


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="parent process only; needs triton")
def test_triton_interpreted() -> None:
    run_interpreted(f"{__file__}::TestInterpreted")


@pytest.mark.skipif(not INTERPRETED, reason="runs inside test_triton_interpreted's child process")
class TestInterpreted:
    """One slice and three (q/k/v, a tile never straddles two), an input width with a masked tail, more rows
    than one row tile, base rows (-1) beside adapter rows, stacks of rank 16 and 32, slots of full rank, rank 8
    and rank 0, the last two with garbage past their rank."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize(
        ("rows", "k", "sizes", "r_stack", "bias"),
        [(5, 96, [64], 16, False), (3, 200, [64, 32, 32], 32, True), (70, 64, [32, 32], 16, False)],
    )
    @pytest.mark.parametrize("slot", [0, 1, 2], ids=["full-rank", "rank-8", "rank-0"])
    def test_matches_torch(
        self, dtype: torch.dtype, rows: int, k: int, sizes: list[int], r_stack: int, bias: bool, slot: int
    ) -> None:
        self.check(dtype, rows, k, sizes, r_stack, bias, slot, None)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("block_m", [64, 128])
    def test_rows_past_one_tile_of_64(self, dtype: torch.dtype, block_m: int) -> None:
        """72 rows (a decode graph bucket past 64) in two tiles of 64, or in one of 128 on 8 warps (`row_tile`'s
        choice), with a masked row tail either way."""
        self.check(dtype, 72, 96, [32, 32], 16, True, 0, block_m)

    @pytest.mark.parametrize("block_k", [32, 64])
    def test_k_tiles_narrower_than_the_pipelines_choice(self, block_k: int) -> None:
        """An input width of 200 in K tiles of 32 or 64 (the sweep's override), the last one masked."""
        self.check(torch.float32, 72, 200, [32, 32], 16, True, 0, 128, block_k)

    @staticmethod
    def check(
        dtype: torch.dtype,
        rows: int,
        k: int,
        sizes: list[int],
        r_stack: int,
        bias: bool,
        slot: int,
        block_m: int | None,
        block_k: int | None = None,
    ) -> None:
        from engine.kernels_gemm_lora import gemm_lora, reference_gemm_lora

        ops = operands(rows, k, sizes, r_stack, dtype, bias)
        # One adapter, with base rows among its rows (and, past `rows`, padding in the last row tile).
        slots = torch.tensor([-1 if t % 3 == 1 else slot for t in range(rows)], dtype=torch.int32)
        args = (ops["x"], ops["w"], ops["bias"], ops["a_stack"], ops["b_stack"], ops["ranks"], ops["scalings"], slots)
        got = gemm_lora(*args, slice_sizes=sizes, block_m=block_m, block_k=block_k)  # type: ignore[arg-type]
        want = reference_gemm_lora(*args, slice_sizes=sizes)  # type: ignore[arg-type]
        assert rel_err(got, want) < TOLERANCE[dtype]
        plain = reference_gemm_lora(*args[:7], torch.full_like(slots, -1), slice_sizes=sizes)  # type: ignore[arg-type]
        if slot != 2:  # the LoRA delta is there to be checked (a rank-0 slot adds none)
            assert rel_err(want, plain) > 10 * TOLERANCE[dtype]
        torch.testing.assert_close(got[slots < 0].float(), plain[slots < 0].float(), rtol=0, atol=TOLERANCE[dtype] * 10)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize(
        ("rows", "k", "split"), [(70, 600, 3), (64, 768, 3), (32, 256, 1)], ids=["masked-tail", "even", "unsplit"]
    )
    def test_split_k_matches_torch_and_repeats_bit_for_bit(
        self, dtype: torch.dtype, rows: int, k: int, split: int
    ) -> None:
        """K split three ways over two row tiles with a masked K tail; or with every K tile and row tile whole (the
        main loop's loads then carry no mask); or unsplit with whole tiles. Bias added once: the same result as the
        reference, the same bits on a second call (split partials are summed in split order), and every tile's
        arrival count back at zero."""
        from engine import kernels_gemm_lora as kg

        sizes = [64, 32, 32]
        ops = operands(rows, k, sizes, 16, dtype, bias=True)
        slots = torch.tensor([-1 if t % 3 == 1 else 0 for t in range(rows)], dtype=torch.int32)
        args = (ops["x"], ops["w"], ops["bias"], ops["a_stack"], ops["b_stack"], ops["ranks"], ops["scalings"], slots)
        got = kg.gemm_lora(*args, slice_sizes=sizes, split_k=split)  # type: ignore[arg-type]
        want = kg.reference_gemm_lora(*args, slice_sizes=sizes)  # type: ignore[arg-type]
        assert rel_err(got, want) < TOLERANCE[dtype]
        assert torch.equal(kg.gemm_lora(*args, slice_sizes=sizes, split_k=split), got)  # type: ignore[arg-type]
        assert not kg._arrivals(torch.device("cpu")).any()
