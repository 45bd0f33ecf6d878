"""A decode step's attention per layer: the triton kernels (`engine.kernels_attention`: rotary fused with the
cache write, keys read in place) against the torch path (rotary in elementwise ops, keys and values gathered
up to the step's KV-length bucket, SDPA behind a mask), side by side in CUDA graphs.

  python bench/decode_attention.py [--layers 8] [--repeats 50]

Each graph runs `--layers` layers with caches of their own (so the L2 cache does not hold them all, but for the
smallest cases, which the line marks); rows sit at random positions in the upper half of their bucket. Both paths
are checked against each other first. Prints us per layer and torch / triton.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine import kernels_attention
from engine.model import DecoderLayer, DecodeView, apply_rope, rope_tables

# (label, query heads, KV heads, head size, batch, KV-length buckets)
CASES = [
    ("SmolLM2-135M", 9, 3, 64, 16, (256, 1024, 4096)),
    ("SmolLM2-135M", 9, 3, 64, 64, (256, 1024, 4096)),
    ("Llama-7B", 32, 32, 128, 64, (512, 2048)),
]


def graph_us(fn: Callable[[], None], layers: int, repeats: int) -> float:
    """Median us per layer of a CUDA graph of `fn` (which runs every layer once)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / layers)
    return statistics.median(times)


def run_case(heads: int, kv_heads: int, head_dim: int, batch: int, max_len: int, layers: int, repeats: int) -> str:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    shape = (batch + 1, kv_heads, max_len, head_dim)
    k_caches = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(layers)]
    v_caches = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(layers)]
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, device=dev, dtype=dtype)
    slots = torch.randperm(batch, device=dev)
    positions = torch.randint(max_len // 2, max_len, (batch,), device=dev)
    cos_table, sin_table = rope_tables(head_dim, max_len, 10000.0)
    cos, sin = cos_table.to(dev, dtype)[positions], sin_table.to(dev, dtype)[positions]
    view = DecodeView.of_buffers(slots, positions, max_len)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim

    def torch_path() -> None:
        for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
            qk = apply_rope(qkv[:, : q_size + kv_size].view(batch, heads + kv_heads, head_dim), cos, sin)
            v = qkv[:, q_size + kv_size :].view(batch, kv_heads, head_dim)
            DecoderLayer._decode_attention(qk[:, :heads], qk[:, heads:], v, k_cache, v_cache, view)

    def triton_path() -> None:
        for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
            q = kernels_attention.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, positions, heads, kv_heads)
            kernels_attention.decode_attention(q, k_cache, v_cache, slots, positions, max_len)

    # Both paths once on the first layer's caches, checked against each other before anything is timed (each
    # writes the same rotated keys and values at the rows' positions, so the caches stay as they were).
    qk = apply_rope(qkv[:, : q_size + kv_size].view(batch, heads + kv_heads, head_dim), cos, sin)
    v = qkv[:, q_size + kv_size :].view(batch, kv_heads, head_dim)
    want = DecoderLayer._decode_attention(qk[:, :heads], qk[:, heads:], v, k_caches[0], v_caches[0], view).float()
    q = kernels_attention.rope_and_cache(qkv, cos, sin, k_caches[0], v_caches[0], slots, positions, heads, kv_heads)
    got = kernels_attention.decode_attention(q, k_caches[0], v_caches[0], slots, positions, max_len).float()
    err = float((got - want).norm() / want.norm())
    if err > 3e-2:
        raise AssertionError(f"triton attention disagrees with the torch path: rel err {err:.2e}")

    # Alternate the two, three times each, and keep each one's best median (the machine is shared).
    torch_us = triton_us = float("inf")
    for _ in range(3):
        torch_us = min(torch_us, graph_us(torch_path, layers, repeats))
        triton_us = min(triton_us, graph_us(triton_path, layers, repeats))
    splits = kernels_attention.split_count(batch, kv_heads, max_len, dev)
    cache_mb = 2 * layers * k_caches[0].numel() * k_caches[0].element_size() / 2**20
    l2_mb = torch.cuda.get_device_properties(dev).L2_cache_size / 2**20
    return (
        f"batch {batch:3d}, KV bucket {max_len:5d}: torch {torch_us:7.1f} us  triton {triton_us:6.1f} us "
        f"({splits} key ranges)  torch / triton x{torch_us / triton_us:.2f}  (rel err {err:.1e}; caches "
        f"{cache_mb:.0f} MiB{', within L2: both paths read them from L2' if cache_mb < l2_mb else ''})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU: the triton kernels are what is measured")
    print(f"{torch.cuda.get_device_name()}, bf16; us per layer, medians of {args.repeats} graph replays")
    for label, heads, kv_heads, head_dim, batch, lengths in CASES:
        for max_len in lengths:
            line = run_case(heads, kv_heads, head_dim, batch, max_len, args.layers, args.repeats)
            print(f"{label:13s} {line}", flush=True)


if __name__ == "__main__":
    main()
