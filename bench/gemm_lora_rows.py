"""The one-adapter LoRA GEMM (`engine/kernels_gemm_lora.py`) just past a decode batch of 64 rows: a request on an
adapter joining 64 base requests makes a step of 65 rows (graph bucket 72), and its prompt folded into the decode
graph one of up to 128. Run on a CUDA machine: `PYTHONPATH=. python3 bench/gemm_lora_rows.py`.

Per row count, side by side in one run, the four projection groups of `--layers` Llama-7B layers (distinct
weights per layer, so that L2 holds none of them between launches), each in one CUDA graph:
- cuBLAS `F.linear`, no LoRA (what a base step runs);
- the LoRA GEMM with rows in tiles of 64 (its row tile before `row_tile`);
- the LoRA GEMM with `row_tile`'s tile (one tile of 128 rows past 64).
Prints us per layer and the ratios: each LoRA GEMM over cuBLAS, and the new row tile over tiles of 64. Every
launch's output is checked against the torch reference first. Times: medians of `triton.testing.do_bench`.

`--sweep`: at each row count, the tile of 128 rows at 4 and 8 warps, BLOCK_K 64 and 128 and 2-6 pipeline stages
(those that fit the GPU's shared memory), per projection group, against `row_tile`'s own choice and cuBLAS in the
same run.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from engine_gpu import capture, median_us  # a sibling script

from engine.kernels_gemm_lora import gemm_lora, reference_gemm_lora, row_tile

DEV = torch.device("cuda")
DTYPE = torch.bfloat16
RANK = 16
GROUPS = {  # Llama-7B: (input width, slices)
    "qkv": (4096, [4096, 4096, 4096]),
    "o": (4096, [4096]),
    "gate_up": (4096, [11008, 11008]),
    "down": (11008, [4096]),
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


class Layer:
    """One layer's weights and rank-16 LoRA stacks (slot 0 holds the adapter) for every group."""

    def __init__(self, gen: torch.Generator) -> None:
        self.w: dict[str, torch.Tensor] = {}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for group, (k, sizes) in GROUPS.items():
            n = sum(sizes)
            self.w[group] = (torch.randn(n, k, device=DEV, generator=gen) * k**-0.5).to(DTYPE)
            a = torch.randn(2, len(sizes) * RANK, k, device=DEV, generator=gen) * k**-0.5
            self.a[group] = a.to(DTYPE)
            self.b[group] = (torch.randn(2, RANK, n, device=DEV, generator=gen) * 0.5).to(DTYPE).transpose(1, 2)


@dataclass(frozen=True, slots=True)
class Launch:
    """`gemm_lora`'s launch overrides; None: its own choice."""

    block_m: int | None = None
    num_stages: int | None = None
    num_warps: int | None = None
    block_k: int | None = None


class Step:
    """One step's inputs at `rows` rows: 64 base rows and a joiner's rows on the adapter (at 64 rows, 8 of
    them), as in goal (d)'s joins; the LoRA GEMM over them with any launch overrides."""

    def __init__(self, rows: int, layers: list[Layer], gen: torch.Generator) -> None:
        self.rows, self.layers = rows, layers
        self.ranks = torch.tensor([RANK, 0], dtype=torch.int32, device=DEV)
        self.scalings = torch.tensor([1.0, 1.0], device=DEV)
        self.x = {g: torch.randn(rows, k, device=DEV, generator=gen).to(DTYPE) for g, (k, _) in GROUPS.items()}
        joiner = max(8, rows - 64)
        self.slots = torch.tensor([0 if t >= rows - joiner else -1 for t in range(rows)], dtype=torch.int32, device=DEV)

    def operands(
        self, layer: Layer, group: str
    ) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`gemm_lora`'s positional operands for one layer's group."""
        x, slots = self.x[group], self.slots
        return (x, layer.w[group], None, layer.a[group], layer.b[group], self.ranks, self.scalings, slots)

    def lora(self, layer: Layer, group: str, launch: Launch) -> torch.Tensor:
        sizes = GROUPS[group][1]
        return gemm_lora(
            *self.operands(layer, group),
            slice_sizes=sizes,
            block_m=launch.block_m,
            num_stages=launch.num_stages,
            num_warps=launch.num_warps,
            block_k=launch.block_k,
        )

    def check(self, launch: Launch) -> None:
        """Every group of the first layer against the torch reference."""
        for group in GROUPS:
            want = reference_gemm_lora(*self.operands(self.layers[0], group), slice_sizes=GROUPS[group][1])
            err = rel_err(self.lora(self.layers[0], group, launch), want)
            if err > 1e-2:
                raise AssertionError(f"{self.rows} rows, {launch}, {group}: rel err {err:.2e}")

    def time_lora(self, launch: Launch, groups: Sequence[str] = tuple(GROUPS)) -> float:
        """us per layer of the LoRA GEMMs of `groups` in every layer, in one graph."""
        return self.time(lambda: [self.lora(layer, g, launch) for layer in self.layers for g in groups])

    def time_cublas(self, groups: Sequence[str] = tuple(GROUPS)) -> float:
        return self.time(lambda: [F.linear(self.x[g], layer.w[g]) for layer in self.layers for g in groups])

    def time(self, fn: Callable[[], list[torch.Tensor]]) -> float:
        return median_us(capture(fn)[0].replay, quick=False) / len(self.layers)


def measure(step: Step) -> str:
    """Check, then time, the three variants; the summary line."""
    tiles_of_64, chosen = Launch(block_m=64), Launch()
    step.check(tiles_of_64)
    step.check(chosen)
    base, tiles64, tiled = step.time_cublas(), step.time_lora(tiles_of_64), step.time_lora(chosen)
    return (
        f"{step.rows:3d} rows: cuBLAS {base:.1f} us per layer; LoRA GEMM tiles of 64 {tiles64:.1f} "
        f"(x{tiles64 / base:.3f} cuBLAS), row_tile {row_tile(step.rows)[0]} {tiled:.1f} (x{tiled / base:.3f} "
        f"cuBLAS); row_tile / tiles of 64 x{tiled / tiles64:.3f}"
    )


def sweep(step: Step) -> list[str]:
    """The 128-row tile's warps, K tile and stages, per projection group: one line per variant that compiles and
    fits, then each group's best beside `row_tile`'s choice."""
    groups = list(GROUPS)
    base = {g: step.time_cublas([g]) for g in groups}
    chosen = {g: step.time_lora(Launch(block_m=128), [g]) for g in groups}
    lines = [f"{step.rows} rows, us per layer (x cuBLAS): " + fmt_groups(chosen, base) + "  <- row_tile's choice"]
    best = dict(chosen)
    best_launch = dict.fromkeys(groups, "the choice")
    for warps, block_k, stages in itertools.product((4, 8), (64, 128), (2, 3, 4, 5, 6)):
        launch = Launch(block_m=128, num_stages=stages, num_warps=warps, block_k=block_k)
        name = f"{warps} warps, BLOCK_K {block_k}, {stages} stages"
        try:
            step.check(launch)
        except AssertionError:
            raise
        except Exception as e:  # a variant that does not fit the GPU (shared memory, registers)
            lines.append(f"  {name}: {type(e).__name__}")
            continue
        times = {g: step.time_lora(launch, [g]) for g in groups}
        lines.append(f"  {name}: " + fmt_groups(times, base))
        for g in groups:
            if times[g] < best[g]:
                best[g], best_launch[g] = times[g], name
    total = sum(best.values()) / sum(chosen.values())
    lines.append(f"  best per group: {fmt_groups(best, base)}; all four x{total:.3f} the choice")
    lines.extend(f"    {g}: {best_launch[g]}" for g in groups)
    return lines


def fmt_groups(times: dict[str, float], base: dict[str, float]) -> str:
    return ", ".join(f"{g} {t:.1f} (x{t / base[g]:.3f})" for g, t in times.items())


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=8, help="layers per graph (distinct weights)")
    parser.add_argument("--rows", default="64,72,96,128", help="row counts (decode graph buckets)")
    parser.add_argument("--sweep", action="store_true", help="the 128-row tile's warps and stages (see above)")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    layers = [Layer(gen) for _ in range(args.layers)]
    summary = []
    for rows in (int(r) for r in args.rows.split(",")):
        step = Step(rows, layers, gen)
        lines = sweep(step) if args.sweep else [measure(step)]
        summary.extend(lines)
        print("\n".join(lines), flush=True)
    print("\n== summary (four projection groups of a Llama-7B layer, one rank-16 adapter, bf16, graphs) ==")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
