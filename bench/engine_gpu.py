"""Multi-LoRA on one GPU at Llama-7B shapes: the triton kernels against gather + torch.bmm, and their share
of a whole decode layer. Run on a CUDA machine: `PYTHONPATH=. python3 bench/engine_gpu.py [--quick] [--sweep]`
(figures for both chunk heights, 1 and 16, are printed side by side; --sweep first runs (s)).

(a) LoRA time per layer (shrink + expand of q, k, v, o, gate, up, down; q/k/v and gate/up fused), decode
    batch 64, rank 16: 64 distinct adapters, 1 adapter, 8 adapters x 8 tokens, and gather + bmm. Layers
    run 4 (2 with --quick) to a graph, their shrink outputs zeroed by one memset per replay, as the engine
    zeroes them once per step (`LayerStack`; figures before 2026-12-03 had a memset per layer).
(c) mixed ranks {8, 16, 32, 64} in one rank-64 stack against uniform rank 16, at equal adapter bytes, with the
    kernels' default latency options, next to the ratios measured before B was stored rank-major; the mix is
    also run with out-major B side by side; then the goal's pair timed in alternating rounds, the figure of
    record. `--only c` runs just (c) (`--quick`: 2 layers, shorter timing).
Every stack stores B as the engine does, rank-major (`[S, R, N]`, passed to the kernels as the transposed
`[S, N, R]` view), but for (c)'s out-major comparison.
(b) one decoder layer's decode step (KV length 512, SDPA, CUDA graph; eager separately): no LoRA,
    1 adapter, 64 distinct adapters, next to the bandwidth bound base_bytes / (base_bytes + adapter_bytes);
    with the current kernels and with the best latency variant of (l).
(s) with --sweep: launch shapes of shrink and expand per chunk height, with the engine's latency options,
    and the best of each half checked and timed beside the defaults (printed; the sections keep the defaults).
(l) latency options of the separate kernels (`engine.kernels_triton`): current, +PDL (programmatic dependent
    launch), +short chain, +both, per mix and chunk height, as ratios to current. `--pdl-only` runs just (l)
    and (b) (a few minutes on an H200, most of it compiling).
Every figure is a ratio measured side by side in this run, after a correctness check against the torch
reference; the summary comes last. Times are medians of `triton.testing.do_bench` (L2 flushed per call).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypeVar

import torch
import torch.nn.functional as F
import triton
import triton.testing

from engine import kernels, kernels_expand, kernels_fused, kernels_shrink, lora_plan
from engine import kernels_triton as kt

HIDDEN, INTER, HEADS, HEAD_DIM, KV_LEN, BATCH, RANK, SLOTS = 4096, 11008, 32, 128, 512, 64, 16, 64
DTYPE = torch.bfloat16
DEV = torch.device("cuda")
SUMMARY: list[str] = []
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Proj:
    """One LoRA'd projection of the layer; several slices share one input (fused q/k/v, gate/up)."""

    name: str
    k: int
    slices: tuple[int, ...]


PROJS = (
    Proj("qkv", HIDDEN, (HIDDEN, HIDDEN, HIDDEN)),
    Proj("o", HIDDEN, (HIDDEN,)),
    Proj("gate_up", HIDDEN, (INTER, INTER)),
    Proj("down", INTER, (HIDDEN,)),
)


@dataclass
class LayerLoRA:
    """Stacked adapters of one layer for every projection, and the step's activations."""

    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    ranks: torch.Tensor
    scalings: torch.Tensor
    xs: dict[str, torch.Tensor] = field(default_factory=dict)
    ys: dict[str, torch.Tensor] = field(default_factory=dict)
    h: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # fp32 [projections, T, max L*R]
    cpu: dict[str, torch.Tensor] = field(default_factory=dict)  # host copies for the reference, made once

    def h_of(self, index: int, lr: int) -> torch.Tensor:
        return self.h[index, :, :lr]

    def on_host(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if key not in self.cpu:
            self.cpu[key] = tensor.cpu()
        return self.cpu[key]


def make_lora(slot_ranks: Sequence[int], max_rank: int, rank_major: bool = True) -> LayerLoRA:
    """Random stacks, zero past each rank; B `[S, N, R]` is a view of a rank-major `[S, R, N]` store (the
    engine's layout), or a contiguous out-major one."""
    ranks = torch.tensor(slot_ranks, dtype=torch.int32, device=DEV)
    keep = torch.arange(max_rank, device=DEV)[None, :] < ranks[:, None]  # [S, R]: zero past each rank
    lora = LayerLoRA({}, {}, ranks, torch.rand(len(slot_ranks), device=DEV) + 0.5)
    for p in PROJS:
        a = torch.randn(len(slot_ranks), len(p.slices), max_rank, p.k, device=DEV) / p.k**0.5
        lora.a[p.name] = (a * keep[:, None, :, None]).to(DTYPE).flatten(1, 2).contiguous()
        b = torch.randn(len(slot_ranks), max_rank, sum(p.slices), device=DEV) / max_rank**0.5
        store = (b * keep[:, :, None]).to(DTYPE)
        lora.b[p.name] = store.contiguous().transpose(1, 2) if rank_major else store.transpose(1, 2).contiguous()
        lora.xs[p.name] = torch.randn(BATCH, p.k, device=DEV).to(DTYPE)
        lora.ys[p.name] = torch.randn(BATCH, sum(p.slices), device=DEV).to(DTYPE)
    # One workspace for the layer's h; `LayerStack` makes it part of one buffer for all its layers.
    lora.h = torch.zeros(len(PROJS) + 3, BATCH, 3 * max_rank, device=DEV)
    return lora


def adapter_bytes(rank: int) -> int:
    """Bytes of one rank-`rank` adapter's A and B over the 7 projections of a layer."""
    return sum(rank * (p.k * len(p.slices) + sum(p.slices)) * 2 for p in PROJS)


def bandwidth_bound(base_bytes: int, lora_bytes: int) -> float:
    """The most a step that also reads `lora_bytes` of adapters can keep of a memory-bound step's throughput."""
    return base_bytes / (base_bytes + lora_bytes)


def activation_bytes() -> int:
    """x read once, y read and written once, per projection."""
    return sum(BATCH * (p.k + 2 * sum(p.slices)) * 2 for p in PROJS)


@dataclass(frozen=True, slots=True)
class Variant:
    """Latency options of the separate kernels (`engine.kernels_triton`), passed explicitly to every launch."""

    name: str
    pdl: bool = False
    short_chain: bool = False


CURRENT = Variant("current")
VARIANTS = (CURRENT, Variant("+pdl", pdl=True), Variant("+short", short_chain=True), Variant("+both", True, True))
DEFAULTS = Variant("defaults", pdl=kt.PDL_BY_DEFAULT, short_chain=kt.SHORT_CHAIN_BY_DEFAULT)  # what the engine runs


@dataclass(frozen=True, slots=True)
class Configs:
    shrink: kt.ShrinkConfig = field(default_factory=kt.ShrinkConfig)
    expand: kt.ExpandConfig = field(default_factory=kt.ExpandConfig)
    variant: Variant = CURRENT


def lora_triton(
    lora: LayerLoRA, plan: lora_plan.SegmentPlan, cfg: Configs, shrink: bool = True, expand: bool = True
) -> None:
    """The layer's 4 shrink + 4 expand launches into a zeroed h (`LayerStack` zeroes every layer's at once, as
    the engine does once per step); either half alone for the sweep."""
    options = {"pdl": cfg.variant.pdl, "short_chain": cfg.variant.short_chain}
    for i, p in enumerate(PROJS):
        h = lora.h_of(i, lora.a[p.name].shape[1])
        if shrink:
            x, a = lora.xs[p.name], lora.a[p.name]
            kernels_shrink.shrink(x, a, lora.ranks, plan, h, num_slices=len(p.slices), config=cfg.shrink, **options)
        if expand:
            kernels_expand.expand(
                lora.ys[p.name],
                h,
                lora.b[p.name],
                lora.ranks,
                lora.scalings,
                plan,
                slice_sizes=p.slices,
                config=cfg.expand,
                **options,
            )


def _run(
    lora: LayerLoRA, *, plan: lora_plan.SegmentPlan, cfg: Configs, shrink: bool = True, expand: bool = True
) -> None:
    lora_triton(lora, plan, cfg, shrink, expand)


def lora_fused(lora: LayerLoRA, plan: lora_plan.SegmentPlan, cfg: kernels_fused.FusedConfig) -> None:
    """The layer's 4 fused shrink + expand launches (no h workspace, no memset)."""
    for p in PROJS:
        kernels_fused.fused(
            lora.ys[p.name],
            lora.xs[p.name],
            lora.a[p.name],
            lora.b[p.name],
            lora.ranks,
            lora.scalings,
            plan,
            slice_sizes=p.slices,
            config=cfg,
        )


def _run_fused(lora: LayerLoRA, *, plan: lora_plan.SegmentPlan, cfg: kernels_fused.FusedConfig) -> None:
    lora_fused(lora, plan, cfg)


# A few launch shapes per chunk height, tried in (a); the default (kernels_fused.default_fused_config) comes first.
FUSED_CANDIDATES: dict[int, tuple[kernels_fused.FusedConfig, ...]] = {
    1: (
        kernels_fused.default_fused_config(1),
        kernels_fused.FusedConfig(block_k=256, block_n=256, num_warps=4, programs_per_sm=4),
        kernels_fused.FusedConfig(block_k=512, block_n=1024, num_warps=8, programs_per_sm=1),
    ),
    16: (
        kernels_fused.default_fused_config(16),
        kernels_fused.FusedConfig(block_k=128, block_n=256, num_warps=4, num_stages=4, programs_per_sm=4),
        kernels_fused.FusedConfig(block_k=512, block_n=1024, num_warps=8, programs_per_sm=1),
        kernels_fused.FusedConfig(block_k=256, block_n=1024, num_warps=4, programs_per_sm=1),
    ),
}
TARGETS = {"64 distinct": 65.0, "1 adapter": 20.0, "8x8": 30.0}


def lora_bmm(lora: LayerLoRA, slots: torch.Tensor) -> None:
    """Baseline: gather every token's A and B ([T, R, K], [T, N, R] copies), then two torch.bmm."""
    scale = lora.scalings[slots.long()][:, None]
    for p in PROJS:
        r = lora.b[p.name].shape[2]
        n0 = 0
        for sl, n in enumerate(p.slices):
            a = lora.a[p.name][:, sl * r : (sl + 1) * r][slots.long()]
            h = torch.bmm(a, lora.xs[p.name].unsqueeze(2))
            b = lora.b[p.name][:, n0 : n0 + n][slots.long()]
            lora.ys[p.name][:, n0 : n0 + n] += (scale * torch.bmm(b, h).squeeze(2)).to(DTYPE)
            n0 += n


def grouped_lora(y: torch.Tensor, x: torch.Tensor, lora: LayerLoRA, name: str, slots: torch.Tensor) -> None:
    """An independent torch path (one matmul pair per adapter present, slice by slice)."""
    r = lora.b[name].shape[2]
    n0 = 0
    for sl, n in enumerate(next(p.slices for p in PROJS if p.name == name)):
        a = lora.a[name][:, sl * r : (sl + 1) * r]
        b = lora.b[name][:, n0 : n0 + n]
        kernels.lora_apply_grouped(y[:, n0 : n0 + n], x, a, b, lora.ranks, lora.scalings, slots)
        n0 += n


def check_lora(lora: LayerLoRA, token_slots: list[int], run: Callable[[], None], label: str) -> None:
    """Run once from fresh y and compare every projection's LoRA delta with the per-token reference."""
    for v in lora.ys.values():
        v.normal_()  # timing replays keep adding into y; start from values of order 1 again
    saved = {k: v.clone() for k, v in lora.ys.items()}
    lora.h.zero_()  # the layer runs leave that to whoever runs them (`LayerStack`)
    run()
    torch.cuda.synchronize()
    slots = torch.tensor(token_slots, dtype=torch.int32)
    worst = 0.0
    for p in PROJS:
        want = saved[p.name].to("cpu", copy=True)
        kernels.lora_apply_reference(
            want,
            lora.on_host(f"x {p.name}", lora.xs[p.name]),
            lora.on_host(f"a {p.name}", lora.a[p.name]),
            lora.on_host(f"b {p.name}", lora.b[p.name]),
            lora.on_host("ranks", lora.ranks),
            lora.on_host("scalings", lora.scalings),
            slots,
            p.slices,
        )
        got = lora.ys[p.name].cpu()
        delta_want, delta_got = (
            want.double() - saved[p.name].cpu().double(),
            got.double() - saved[p.name].cpu().double(),
        )
        worst = max(worst, float((delta_got - delta_want).norm() / delta_want.norm().clamp_min(1e-30)))
    for k, v in saved.items():
        lora.ys[k].copy_(v)
    status = "ok" if worst < 2e-2 else "MISMATCH"
    print(f"  check {label}: rel err of the LoRA delta {worst:.2e} {status}")
    if status != "ok":
        raise AssertionError(f"{label} disagrees with the reference")


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """A CUDA graph of `fn` (run twice first, to compile outside the capture) and its captured result."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    return capture(fn)[0]


def median_us(fn: Callable[[], object], quick: bool) -> float:
    return (
        float(triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 150, return_mode="median"))
        * 1e3
    )


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    t = median_us(lambda: dst.copy_(src), quick=False)
    return 2 * src.numel() / (t * 1e-6)


def scenario_slots() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {
        "64 distinct": torch.randperm(SLOTS, generator=gen).tolist(),
        "1 adapter": [5] * BATCH,
        "8x8": [t % 8 for t in range(BATCH)],
    }


class LayerStack:
    """`layers` independent layers' adapters, replayed as one graph so that L2 holds none of them. Their h
    workspaces are one buffer, zeroed by one memset per replay, as the engine zeroes one per step for all
    its layers (until 2026-12-03 the bench zeroed each layer's: 2.3-3.7 us of each layer's time)."""

    def __init__(
        self, slot_ranks: Sequence[int], max_rank: int, layers: int, block_m: int = 16, rank_major: bool = True
    ):
        self.loras = [make_lora(slot_ranks, max_rank, rank_major) for _ in range(layers)]
        self.h = torch.zeros(layers, *self.loras[0].h.shape, device=DEV)
        for lora, h in zip(self.loras, self.h, strict=True):
            lora.h = h
        self.capacity = lora_plan.chunk_capacity(BATCH, len(slot_ranks), block_m)
        self.block_m = block_m
        self.plan = lora_plan.plan_segments(list(range(BATCH)), DEV, block_m=block_m, num_chunks=self.capacity)

    def use(self, token_slots: list[int]) -> None:
        self.plan.copy_(lora_plan.plan_segments(token_slots, DEV, block_m=self.block_m, num_chunks=self.capacity))

    def graph(self, fn: Callable[[LayerLoRA], None], uses_h: bool = True) -> torch.cuda.CUDAGraph:
        """One replay runs `fn` on every layer; `uses_h`: after one memset of every layer's h."""

        def all_layers() -> None:
            if uses_h:
                self.h.zero_()
            for lora in self.loras:
                fn(lora)

        return graph_of(all_layers)

    def per_layer_us(self, fn: Callable[[LayerLoRA], None], quick: bool, uses_h: bool = True) -> float:
        return median_us(self.graph(fn, uses_h).replay, quick) / len(self.loras)


def section_kernels(args: argparse.Namespace, bw: float) -> dict[int, kernels_fused.FusedConfig]:
    """(a) for each chunk height (1: per-token matrix-vector programs; 16: tensor-core tiles): the separate
    shrink + expand kernels (default shapes) and the fused kernel (a few shapes), side by side."""
    print("\n(a) LoRA per layer, decode batch 64, rank 16, 7 projections (q/k/v and gate/up fused)")
    layers = 2 if args.quick else 4
    scen = scenario_slots()
    chosen: dict[int, kernels_fused.FusedConfig] = {}
    best_sep: dict[str, tuple[float, int]] = {}
    best_fused: dict[str, tuple[float, int, kernels_fused.FusedConfig]] = {}
    bmm = dict.fromkeys(scen, float("nan"))  # per mix: gather + bmm reads one A and B per token, L2 serves repeats
    for block_m in (1, 16):
        stack = LayerStack([RANK] * SLOTS, RANK, layers, block_m)
        cfg = Configs(*kt.default_configs(block_m))
        for name, slots in scen.items():
            stack.use(slots)
            check_lora(
                stack.loras[0], slots, partial(_run, stack.loras[0], plan=stack.plan, cfg=cfg), f"{name} m{block_m}"
            )
            t = stack.per_layer_us(partial(_run, plan=stack.plan, cfg=cfg), args.quick)
            floor = (len(set(slots)) * adapter_bytes(RANK) + activation_bytes()) / bw * 1e6
            print(f"  chunks of {block_m:2d}: {name:12s} shrink+expand {t:7.1f} us/layer  HBM floor {floor:5.1f} us")
            if name not in best_sep or t < best_sep[name][0]:
                best_sep[name] = (t, block_m)
        totals: list[tuple[float, kernels_fused.FusedConfig]] = []
        for fcfg in FUSED_CANDIDATES[block_m]:
            times: dict[str, float] = {}
            for name, slots in scen.items():
                stack.use(slots)
                label = f"{name} m{block_m} fused {fcfg}"
                check_lora(stack.loras[0], slots, partial(_run_fused, stack.loras[0], plan=stack.plan, cfg=fcfg), label)
                times[name] = stack.per_layer_us(
                    partial(_run_fused, plan=stack.plan, cfg=fcfg), args.quick, uses_h=False
                )
                if name not in best_fused or times[name] < best_fused[name][0]:
                    best_fused[name] = (times[name], block_m, fcfg)
            print(f"  chunks of {block_m:2d}: fused {fcfg}: " + ", ".join(f"{n} {t:6.1f}" for n, t in times.items()))
            # Rank shapes by their worst ratio to the targets: the default must serve every batch mix.
            totals.append((max(times[n] / TARGETS[n] for n in times), fcfg))
        chosen[block_m] = min(totals, key=lambda item: item[0])[1]
        if block_m == 1:
            for name, slots in scen.items():
                slots_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
                check_lora(stack.loras[0], slots, partial(lora_bmm, stack.loras[0], slots_t), f"gather+bmm {name}")
                bmm[name] = stack.per_layer_us(partial(lora_bmm, slots=slots_t), args.quick, uses_h=False)
                print(f"  gather + torch.bmm, {name:12s}: {bmm[name]:7.1f} us/layer")
        del stack
        torch.cuda.empty_cache()
    for name, slots in scen.items():
        t, block_m, fcfg = best_fused[name]
        sep, sep_m = best_sep[name]
        floor = (len(set(slots)) * adapter_bytes(RANK) + activation_bytes()) / bw * 1e6
        SUMMARY.append(
            f"(a) {name:12s}: fused {t:6.1f} us/layer (chunks of {block_m}, {fcfg}); target <= {TARGETS[name]:.0f}; "
            f"HBM floor {floor:4.1f}; shrink+expand {sep:6.1f} (chunks of {sep_m}) x{sep / t:.2f}; "
            f"gather+bmm (same mix) x{bmm[name] / t:.1f}"
        )
    SUMMARY.append("(a) gather + torch.bmm: " + ", ".join(f"{n} {t:6.1f} us/layer" for n, t in bmm.items()))
    for block_m, fcfg in chosen.items():
        SUMMARY.append(f"(a) best fused shape over all three mixes, chunks of {block_m:2d}: {fcfg}")
    return chosen


def section_latency(args: argparse.Namespace, bw: float) -> dict[int, Variant]:
    """(l) the separate kernels with each latency option, per chunk height, side by side; each variant is
    checked eagerly and again replayed from its CUDA graph before it is timed. Returns the best variant per
    chunk height (by its worst ratio to the targets, as for the fused shapes)."""
    print("\n(l) latency options, LoRA per layer (us), decode batch 64, rank 16, 7 projections; ratio to current")
    layers = 2 if args.quick else 4
    scen = scenario_slots()
    best: dict[int, Variant] = {}
    for block_m in (1, 16):
        stack = LayerStack([RANK] * SLOTS, RANK, layers, block_m)
        times: dict[str, dict[str, float]] = {}
        for variant in VARIANTS:
            cfg = replace(Configs(*kt.default_configs(block_m)), variant=variant)
            times[variant.name] = dict.fromkeys(scen, math.nan)
            try:
                graph = stack.graph(partial(_run, plan=stack.plan, cfg=cfg))
            except Exception as exc:  # a variant that cannot be captured is reported, not fatal
                print(f"  chunks of {block_m:2d} {variant.name}: graph capture failed, skipped: {exc!r}")
                continue
            for name, slots in scen.items():
                stack.use(slots)
                label = f"{name} m{block_m} {variant.name}"
                check_lora(stack.loras[0], slots, partial(_run, stack.loras[0], plan=stack.plan, cfg=cfg), label)
                check_lora(stack.loras[0], slots, graph.replay, label + " (graph)")
                times[variant.name][name] = median_us(graph.replay, args.quick) / layers
            del graph
        current = times[CURRENT.name]
        print(f"  chunks of {block_m:2d}  " + "".join(f"{name:>12s}        " for name in scen))
        for variant in VARIANTS:
            row = times[variant.name]
            cells = "".join(f"{row[n]:12.1f} {f'x{row[n] / current[n]:.2f}':7s}" for n in scen)
            print(f"    {variant.name:10s}  {cells}")
        floors = {n: (len(set(sl)) * adapter_bytes(RANK) + activation_bytes()) / bw * 1e6 for n, sl in scen.items()}
        print("    HBM floor   " + "".join(f"{floors[n]:12.1f}        " for n in scen))
        print("    target      " + "".join(f"{TARGETS[n]:12.1f}        " for n in scen))
        scored = [(max(times[v.name][n] / TARGETS[n] for n in scen), v) for v in VARIANTS]
        ok = [item for item in scored if not math.isnan(item[0])]
        best[block_m] = min(ok, key=lambda item: item[0])[1] if ok else CURRENT
        for variant in VARIANTS:
            row = times[variant.name]
            SUMMARY.append(
                f"(l) chunks of {block_m:2d}, {variant.name:8s}: "
                + ", ".join(f"{n} {row[n]:6.1f} us (x{row[n] / current[n]:.2f})" for n in scen)
            )
        SUMMARY.append(f"(l) chunks of {block_m:2d}: best variant over all three mixes {best[block_m].name}")
        del stack
        torch.cuda.empty_cache()
    return best


SHRINK_GRID: dict[str, tuple[int, ...]] = {
    "block_k": (128, 256, 512),
    "num_warps": (2, 4, 8),
    "programs_per_sm": (4, 8, 16),
}
EXPAND_GRID: dict[str, tuple[int, ...]] = {
    "block_n": (512, 1024, 2048),
    "num_warps": (2, 4, 8),
    "programs_per_sm": (2, 4, 8),
}


def _grid(grid: dict[str, tuple[int, ...]]) -> list[dict[str, int]]:
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def _mix_times(
    stack: LayerStack, scen: dict[str, list[int]], cfg: Configs, quick: bool, shrink: bool = True, expand: bool = True
) -> dict[str, float]:
    """us per layer of `cfg` for each mix (either half alone, or both)."""
    out = {}
    for name, slots in scen.items():
        stack.use(slots)
        run = partial(_run, plan=stack.plan, cfg=cfg, shrink=shrink, expand=expand)
        out[name] = stack.per_layer_us(run, quick, uses_h=shrink)  # expand alone needs no zeroed h
    return out


def _show(block_m: int, label: str, times: dict[str, float], is_default: bool) -> None:
    cells = " ".join(f"{t:6.1f}" for t in times.values())
    print(f"  chunks of {block_m:2d} {label}: {cells}{'  <- default' if is_default else ''}")


def section_sweep(args: argparse.Namespace) -> None:
    """(s) launch shapes of shrink and of expand, each half timed alone, per chunk height, with the latency
    options the engine runs with (PDL, short chain); the best of each half (by its sum over the three mixes)
    is then checked and timed beside the defaults. Prints only: the sections keep the defaults."""
    print("\n(s) launch-shape sweep, us per layer (64 distinct, 1 adapter, 8x8), latency options on")
    layers = 2 if args.quick else 4
    scen = scenario_slots()
    for block_m in (1, 16):
        stack = LayerStack([RANK] * SLOTS, RANK, layers, block_m)
        defaults = Configs(*kt.default_configs(block_m), variant=DEFAULTS)
        best = defaults
        for half, grid in (("shrink", SHRINK_GRID), ("expand", EXPAND_GRID)):
            tried: list[tuple[float, Configs]] = []
            for fields in _grid(grid):
                cfg = replace(defaults, **{half: replace(getattr(defaults, half), **fields)})
                t = _mix_times(stack, scen, cfg, args.quick, shrink=half == "shrink", expand=half == "expand")
                _show(block_m, f"{half} {fields}", t, cfg == defaults)
                tried.append((sum(t.values()), cfg))
            best = replace(best, **{half: getattr(min(tried, key=lambda r: r[0])[1], half)})
        for name, slots in scen.items():
            stack.use(slots)
            check_lora(stack.loras[0], slots, partial(_run, stack.loras[0], plan=stack.plan, cfg=best), f"best {name}")
        t_default, t_best = _mix_times(stack, scen, defaults, args.quick), _mix_times(stack, scen, best, args.quick)
        _show(block_m, "defaults, shrink + expand", t_default, True)
        _show(block_m, f"best halves together {best.shrink} {best.expand}", t_best, False)
        SUMMARY.append(
            f"(s) chunks of {block_m:2d}: best halves together / defaults: "
            + ", ".join(f"{n} x{t_best[n] / t_default[n]:.2f}" for n in scen)
        )
        del stack
        torch.cuda.empty_cache()


# (c) before B was stored rank-major (bench/RESULTS-gpu.md, session 2026-12-02 (second), default latency
# options), as ratios to uniform 16 in a rank-16 stack: chunks of 1, chunks of 16.
OLD_MIXED = {
    "uniform 16 (stack R=64)": (1.40, 1.23),
    "mixed 8/16/32/64 (R=64)": (1.48, 1.39),
}
# Out-major B ran per-token expand at 512 columns (its swept shape; at 1024 its tile body took 168 registers).
OUT_MAJOR_EXPAND = {1: kt.ExpandConfig(block_n=512, programs_per_sm=4)}


def mixed_ranks_and_slots() -> tuple[list[int], list[int]]:
    """(c)'s ranks 8/16/32/64 per slot (sum 1024 = 64 x 16: equal bytes to uniform 16) and the tokens' slots,
    both shuffled with a fixed seed so that every section times the same mix."""
    gen = torch.Generator().manual_seed(1)
    mixed = [8] * 40 + [16] * 12 + [32] * 8 + [64] * 4
    mixed = [mixed[i] for i in torch.randperm(SLOTS, generator=gen).tolist()]
    return mixed, torch.randperm(SLOTS, generator=gen).tolist()


def section_mixed(args: argparse.Namespace, configs: dict[int, Configs], bw: float) -> None:
    """(c) with the kernels' default latency options; shrink and expand also timed apart for the two stacks
    the goal compares (mixed <= 1.05x uniform 16 at equal bytes) and for the mix with out-major B."""
    print("\n(c) mixed ranks, 64 distinct adapters, equal adapter bytes (ratios to uniform 16 in a rank-16 stack)")
    mixed, slots = mixed_ranks_and_slots()
    layers = 2 if args.quick else 4
    base, goal, out_major = "uniform 16 (stack R=16)", "mixed 8/16/32/64 (R=64)", "mixed, out-major B"
    variants = {  # name: ranks, stack R, B rank-major
        base: ([RANK] * SLOTS, RANK, True),
        "uniform 16 (stack R=64)": ([RANK] * SLOTS, 64, True),
        goal: (mixed, 64, True),
        out_major: (mixed, 64, False),
        "all 64 (4x the bytes)": ([64] * SLOTS, 64, True),
    }
    for column, (block_m, rank_major_cfg) in enumerate(configs.items()):
        rank_major_cfg = replace(rank_major_cfg, variant=DEFAULTS)
        times: dict[str, float] = {}
        halves: dict[str, tuple[float, float]] = {}
        for name, (ranks, max_rank, rank_major) in variants.items():
            cfg = rank_major_cfg
            if not rank_major and block_m in OUT_MAJOR_EXPAND:
                cfg = replace(cfg, expand=OUT_MAJOR_EXPAND[block_m])
            stack = LayerStack(ranks, max_rank, layers, block_m, rank_major)
            stack.use(slots)
            check_lora(stack.loras[0], slots, partial(_run, stack.loras[0], plan=stack.plan, cfg=cfg), name)
            graph = stack.graph(partial(_run, plan=stack.plan, cfg=cfg))
            check_lora(stack.loras[0], slots, graph.replay, name + " (graph)")
            times[name] = median_us(graph.replay, args.quick) / layers
            del graph
            if name in (base, goal, out_major):
                halves[name] = (
                    stack.per_layer_us(partial(_run, plan=stack.plan, cfg=cfg, expand=False), args.quick),
                    stack.per_layer_us(partial(_run, plan=stack.plan, cfg=cfg, shrink=False), args.quick, uses_h=False),
                )
            nbytes = sum(adapter_bytes(r) for r in ranks) + activation_bytes()
            ratio = times[name] / times[base]
            old = f"(was x{OLD_MIXED[name][column]:.2f})" if name in OLD_MIXED else ""
            print(
                f"  chunks of {block_m:2d}: {name:26s} {times[name]:7.1f} us/layer  x{ratio:.2f} {old:12s} "
                f"floor {nbytes / bw * 1e6:5.1f} us"
            )
            del stack
            torch.cuda.empty_cache()
        for name, (shrink_us, expand_us) in halves.items():
            print(f"  chunks of {block_m:2d}: {name:26s} shrink+memset {shrink_us:6.1f} us, expand {expand_us:6.1f} us")
        rel = {name: t / times[base] for name, t in times.items()}
        SUMMARY.append(
            f"(c) chunks of {block_m:2d}, {DEFAULTS.name}, timed one after the other: mixed/uniform-16 at equal bytes "
            f"x{rel[goal]:.2f} (was x{OLD_MIXED[goal][column]:.2f}; the goal's figure for decode is the alternating "
            f"rounds' below); out-major B x{rel[out_major]:.2f}; "
            f"uniform 16 in an R=64 stack x{rel['uniform 16 (stack R=64)']:.2f} "
            f"(was x{OLD_MIXED['uniform 16 (stack R=64)'][column]:.2f}); "
            f"all rank 64 x{rel['all 64 (4x the bytes)']:.2f}; uniform 16: {times[base]:.1f} us; shrink/expand "
            + ", ".join(f"{n.split(' (')[0]} {sh:.1f}/{ex:.1f} us" for n, (sh, ex) in halves.items())
        )


# Expand launch shapes compared in (c) for decode (chunks of 1): the column tile, the rank rows per work unit, and
# whether chunks of rank <= 8 read tiles of 8 rows by twice the columns (`ExpandConfig.half_blocks`, the default
# from stop 31). Tiles of 256 columns, compared before, took about 4x as long (bench/RESULTS-gpu.md).
EXPAND_SHAPES = [(1024, 16, True), (1024, 16, False), (1024, 8, False), (512, 16, False)]


def section_mixed_expand_shapes(args: argparse.Namespace, configs: dict[int, Configs]) -> None:
    """(c), decode: the goal's ratio under other expand launch shapes, each against uniform 16 with the same
    shape and with the default one. A rank-64 chunk's programs each loop over 4 rank blocks of at least one
    column tile, so narrower tiles split it finer; units of 8 rank rows give a rank-8 chunk half the programs;
    half blocks give a rank-8 chunk's program one round trip for two column tiles instead of two."""
    print("\n(c) decode, expand launch shapes (block_n, rank rows per unit, half blocks): mixed ranks vs uniform 16")
    mixed, slots = mixed_ranks_and_slots()
    layers = 2 if args.quick else 4
    stacks = {
        "uniform 16 (R=16)": ([RANK] * SLOTS, RANK),
        "uniform 16 (R=64)": ([RANK] * SLOTS, 64),
        "mixed": (mixed, 64),
    }
    default = replace(configs[1], variant=DEFAULTS)
    times: dict[tuple[int, int, bool], dict[str, float]] = {}
    for name, (ranks, max_rank) in stacks.items():
        stack = LayerStack(ranks, max_rank, layers, 1, True)
        stack.use(slots)
        for bn, rows, half in EXPAND_SHAPES:
            cfg = replace(default, expand=replace(default.expand, block_n=bn, unit_rows=rows, half_blocks=half))
            graph = stack.graph(partial(_run, plan=stack.plan, cfg=cfg))
            check_lora(stack.loras[0], slots, graph.replay, f"{name}, expand {bn}/{rows}/{half} (graph)")
            times.setdefault((bn, rows, half), {})[name] = median_us(graph.replay, args.quick) / layers
            del graph
        del stack
        torch.cuda.empty_cache()
    ref = times[(default.expand.block_n, default.expand.unit_rows, default.expand.half_blocks)]["uniform 16 (R=16)"]
    for (bn, rows, half), row in times.items():
        line = (
            f"(c) decode, expand {bn:4d} cols / {rows:2d} rows per unit / half blocks {'on ' if half else 'off'}: "
            + ", ".join(f"{n} {t:5.1f} us" for n, t in row.items())
            + f"; mixed x{row['mixed'] / row['uniform 16 (R=16)']:.2f} the same shape's uniform 16,"
            f" x{row['mixed'] / ref:.2f} the default's"
        )
        print("  " + line)
        SUMMARY.append(line)


def section_mixed_alternating(args: argparse.Namespace, configs: dict[int, Configs]) -> None:
    """(c), decode, the goal's pair timed in turns: the sections above time each stack once, one after the other,
    and their uniform-16 baselines differed by 3.5% (stop 32). Here both graphs exist at once and each round
    times one, then the other (the order switching every round); the figure is the median of the rounds'
    ratios."""
    mixed, slots = mixed_ranks_and_slots()
    layers = 2 if args.quick else 4
    rounds = 6 if args.quick else 16
    cfg = replace(configs[1], variant=DEFAULTS)
    stacks = {
        "uniform 16 (R=16)": LayerStack([RANK] * SLOTS, RANK, layers, 1, True),
        "mixed": LayerStack(mixed, 64, layers, 1, True),
    }
    graphs = {}
    for name, stack in stacks.items():
        stack.use(slots)
        graphs[name] = stack.graph(partial(_run, plan=stack.plan, cfg=cfg))
        check_lora(stack.loras[0], slots, graphs[name].replay, f"{name}, alternating (graph)")
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for i in range(rounds):
        for name in list(graphs)[:: 1 if i % 2 == 0 else -1]:
            times[name].append(median_us(graphs[name].replay, args.quick) / layers)
    ratios = sorted(m / u for m, u in zip(times["mixed"], times["uniform 16 (R=16)"], strict=True))
    ratio = statistics.median(ratios)
    uniform, mix = (statistics.median(times[name]) for name in ("uniform 16 (R=16)", "mixed"))
    line = (
        f"(c) decode, alternating, {rounds} rounds: uniform 16 (R=16) {uniform:5.1f} us, mixed {mix:5.1f} us a layer; "
        f"mixed/uniform x{ratio:.3f} (median of rounds; range x{ratios[0]:.3f}-x{ratios[-1]:.3f}; goal <= 1.05 "
        f"{'met' if ratio <= 1.05 else 'NOT met'})"
    )
    print("\n" + line)
    SUMMARY.append(line)
    del graphs, stacks
    torch.cuda.empty_cache()


class DecodeLayer:
    """One Llama-7B decoder layer with random bf16 weights and a KV cache of KV_LEN positions."""

    def __init__(self) -> None:
        def w(out: int, inp: int) -> torch.Tensor:
            return (torch.randn(out, inp, device=DEV) / inp**0.5).to(DTYPE)

        self.w = {
            "qkv": w(3 * HIDDEN, HIDDEN),
            "o": w(HIDDEN, HIDDEN),
            "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER),
        }
        self.norm1 = torch.ones(HIDDEN, device=DEV, dtype=DTYPE)
        self.norm2 = torch.ones(HIDDEN, device=DEV, dtype=DTYPE)
        self.k_cache = torch.randn(BATCH, HEADS, KV_LEN, HEAD_DIM, device=DEV).to(DTYPE)
        self.v_cache = torch.randn(BATCH, HEADS, KV_LEN, HEAD_DIM, device=DEV).to(DTYPE)
        angle = (KV_LEN - 1) / 10000 ** (torch.arange(0, HEAD_DIM, 2, device=DEV) / HEAD_DIM)
        self.cos = torch.cat([angle.cos(), angle.cos()]).to(DTYPE)
        self.sin = torch.cat([angle.sin(), angle.sin()]).to(DTYPE)
        self.x = torch.randn(BATCH, HIDDEN, device=DEV).to(DTYPE)

    def base_bytes(self) -> int:
        weights = sum(t.numel() * 2 for t in self.w.values())
        return weights + 2 * self.k_cache.numel() * 2 + 12 * BATCH * (HIDDEN + INTER) * 2

    def rope(self, t: torch.Tensor) -> torch.Tensor:
        half = HEAD_DIM // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * self.cos + rotated * self.sin

    def step(
        self,
        lora: Callable[[str, torch.Tensor, torch.Tensor], None] | None,
        before: Callable[[str, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """`before(name, x)` runs ahead of each projection's GEMM, `lora(name, x, y)` after it."""

        def proj(name: str, x: torch.Tensor) -> torch.Tensor:
            if before is not None:
                before(name, x)
            y = x @ self.w[name].t()
            if lora is not None:
                lora(name, x, y)
            return y

        h = F.rms_norm(self.x, (HIDDEN,), self.norm1, 1e-5)
        q, k, v = proj("qkv", h).view(BATCH, 3, HEADS, HEAD_DIM).unbind(1)
        self.k_cache[:, :, -1] = self.rope(k)
        self.v_cache[:, :, -1] = v
        attn = F.scaled_dot_product_attention(self.rope(q).unsqueeze(2), self.k_cache, self.v_cache)
        x = self.x + proj("o", attn.reshape(BATCH, HIDDEN))
        gate, up = proj("gate_up", F.rms_norm(x, (HIDDEN,), self.norm2, 1e-5)).chunk(2, dim=-1)
        return x + proj("down", F.silu(gate) * up)


def section_decode_layer(args: argparse.Namespace, runs: Sequence[tuple[int, Configs]]) -> None:
    """(b) for each (chunk height, kernel configs and latency variant) in `runs`."""
    print("\n(b) one Llama-7B decoder layer, decode step: batch 64, KV length 512, SDPA")
    layer = DecodeLayer()
    lora = make_lora([RANK] * SLOTS, RANK)
    slices = {p.name: p.slices for p in PROJS}
    index = {p.name: i for i, p in enumerate(PROJS)}
    scen = scenario_slots()
    base_out = layer.step(None)

    def base_step() -> None:
        layer.step(None)

    base = (median_us(graph_of(base_step).replay, args.quick), median_us(base_step, args.quick))
    print(f"  no LoRA                  graph {base[0]:7.1f} us   eager {base[1]:7.1f} us")
    base_bytes = layer.base_bytes()
    side = torch.cuda.Stream(DEV)
    # The LoRA deltas of `full` overlap: one buffer, zeroed once per layer on the side stream.
    widths = {p.name: sum(p.slices) for p in PROJS}
    delta_all = torch.zeros(BATCH, sum(widths.values()), device=DEV, dtype=DTYPE)
    deltas, n0 = {}, 0
    for p in PROJS:
        deltas[p.name], n0 = delta_all[:, n0 : n0 + widths[p.name]], n0 + widths[p.name]
    modes = ("", "overlap", "full overlap")
    for block_m, cfg, overlap in [(m, c, o) for m, c in runs for o in (modes if m == 1 else ("",))]:
        capacity = lora_plan.chunk_capacity(BATCH, SLOTS, block_m)
        plan = lora_plan.plan_segments(list(range(BATCH)), DEV, block_m=block_m, num_chunks=capacity)
        tag = f"chunks of {block_m:2d} {cfg.variant.name:8s}{' +' + overlap if overlap else ''}"

        def shrink(name: str, x: torch.Tensor, plan: lora_plan.SegmentPlan = plan, cfg: Configs = cfg) -> None:
            if index[name] == 0:
                lora.h.zero_()  # the layer's one memset, before its first projection
            h = lora.h_of(index[name], lora.a[name].shape[1])
            sl, opts = slices[name], {"pdl": cfg.variant.pdl, "short_chain": cfg.variant.short_chain}
            kernels_shrink.shrink(x, lora.a[name], lora.ranks, plan, h, num_slices=len(sl), config=cfg.shrink, **opts)

        def expand(name: str, y: torch.Tensor, plan: lora_plan.SegmentPlan = plan, cfg: Configs = cfg) -> None:
            h = lora.h_of(index[name], lora.a[name].shape[1])
            sl, opts = slices[name], {"pdl": cfg.variant.pdl, "short_chain": cfg.variant.short_chain}
            kernels_expand.expand(
                y, h, lora.b[name], lora.ranks, lora.scalings, plan, slice_sizes=sl, config=cfg.expand, **opts
            )

        def triton_lora(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
            shrink(name, x)
            expand(name, y)

        # Overlapped: each shrink runs on a side stream beside its projection's base GEMM (both read only x);
        # the expand joins after the GEMM.
        def shrink_beside(name: str, x: torch.Tensor) -> None:
            side.wait_stream(torch.cuda.current_stream(DEV))
            with torch.cuda.stream(side):
                shrink(name, x)

        def expand_after(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
            torch.cuda.current_stream(DEV).wait_stream(side)
            expand(name, y)

        # Full overlap: shrink and expand both run on the side stream beside the GEMM, the expand into a zeroed
        # delta; after the GEMM the main stream adds the delta (one small kernel in the GEMM's wake).
        def lora_beside(name: str, x: torch.Tensor) -> None:
            side.wait_stream(torch.cuda.current_stream(DEV))
            with torch.cuda.stream(side):
                if index[name] == 0:
                    delta_all.zero_()
                shrink(name, x)
                expand(name, deltas[name])

        def add_after(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
            torch.cuda.current_stream(DEV).wait_stream(side)
            y.add_(deltas[name])

        def lora_step(overlap: str = overlap) -> torch.Tensor:
            if overlap == "overlap":
                return layer.step(expand_after, shrink_beside)
            if overlap == "full overlap":
                return layer.step(add_after, lora_beside)
            return layer.step(triton_lora)

        wants: dict[str, torch.Tensor] = {}
        for name in ("1 adapter", "64 distinct"):
            plan.copy_(lora_plan.plan_segments(scen[name], DEV, block_m=block_m, num_chunks=capacity))
            got = lora_step()
            slots = torch.tensor(scen[name], dtype=torch.int32, device=DEV)
            wants[name] = layer.step(partial(grouped_lora_hook, lora=lora, slots=slots))
            err = float((got - wants[name]).double().norm() / (wants[name] - base_out).double().norm())
            print(f"  check layer, {name}, {tag}: rel err of the LoRA effect {err:.2e}")
            if err > 3e-2:
                raise AssertionError("decode layer with LoRA disagrees with the torch path")
        try:
            graph, graph_out = capture(lora_step)
        except Exception as exc:  # e.g. PDL refused under capture: report, keep measuring the rest
            print(f"  {tag}: graph capture failed, skipped: {exc!r}")
            continue
        for name, distinct in (("1 adapter", 1), ("64 distinct", SLOTS)):
            plan.copy_(lora_plan.plan_segments(scen[name], DEV, block_m=block_m, num_chunks=capacity))
            graph.replay()
            err = float((graph_out - wants[name]).double().norm() / (wants[name] - base_out).double().norm())
            print(f"  check layer graph replay, {name}, {tag}: rel err of the LoRA effect {err:.2e}")
            if err > 3e-2:
                raise AssertionError("decode layer graph with LoRA disagrees with the torch path")
            t = (median_us(graph.replay, args.quick), median_us(lora_step, args.quick))
            print(f"  {name:12s} {tag} graph {t[0]:7.1f} us   eager {t[1]:7.1f} us")
            bound = bandwidth_bound(base_bytes, distinct * adapter_bytes(RANK))
            SUMMARY.append(
                f"(b) layer, {name:11s}, {tag}: graph {t[0]:6.1f} us vs no LoRA {base[0]:6.1f} us: "
                f"throughput x{base[0] / t[0]:.3f} (bandwidth bound x{bound:.3f}, {base[0] / t[0] / bound:.3f} of it); "
                f"eager {t[1]:.1f} vs {base[1]:.1f} us"
            )


def grouped_lora_hook(name: str, x: torch.Tensor, y: torch.Tensor, *, lora: LayerLoRA, slots: torch.Tensor) -> None:
    grouped_lora(y, x, lora, name, slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer layers and repeats")
    parser.add_argument("--sweep", action="store_true", help="(s) first: sweep launch shapes, print the best")
    parser.add_argument("--only", default="albc", help="sections to run, e.g. 'ab'")
    parser.add_argument("--pdl-only", action="store_true", help="only (l), the latency options, and then (b)")
    args = parser.parse_args()
    if args.pdl_only:
        args.only = "lb"
    props = torch.cuda.get_device_properties(DEV)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    bw = copy_bandwidth()
    print(f"device copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    SUMMARY.append(
        f"{props.name}; copy bandwidth {bw / 1e12:.2f} TB/s; torch {torch.__version__}, triton {triton.__version__}"
    )
    # (b) and (c) run the separate shrink + expand kernels: (a) measured them faster than the fused one.
    configs = {block_m: Configs(*kt.default_configs(block_m)) for block_m in (1, 16)}
    failed = False
    if args.sweep:
        try:
            section_sweep(args)
        except Exception:
            traceback.print_exc()
            failed = True
    if "a" in args.only:
        try:
            section_kernels(args, bw)
        except Exception:
            traceback.print_exc()
            failed = True
    # (b) runs the current kernels and the best latency variant of (l) (+both when (l) does not run).
    best = {block_m: VARIANTS[-1] for block_m in configs}
    if "l" in args.only:
        try:
            best = section_latency(args, bw)
        except Exception:
            traceback.print_exc()
            failed = True
    if "c" in args.only:
        try:
            section_mixed(args, configs, bw)
            section_mixed_expand_shapes(args, configs)
            section_mixed_alternating(args, configs)
        except Exception:
            traceback.print_exc()
            failed = True
    if "b" in args.only:
        runs = [(m, cfg) for m, cfg in configs.items()]
        runs += [(m, replace(configs[m], variant=v)) for m, v in best.items() if v != CURRENT]
        try:
            section_decode_layer(args, runs)
        except Exception:
            traceback.print_exc()
            failed = True
    print("\n== summary ==")
    for line in SUMMARY:
        print(line)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
