"""Every triton kernel of a decode or prefill step, compiled for an H200 at the engine's real shapes and launch
configurations, on this CPU (`tests.support.compile_only`): each compiles, and each program's shared memory fits
the GPU. The GPU tests (`tests/gpu`) run them; these catch what fails before the first launch, without a GPU.

Shapes: Llama-7B (the speed target) and SmolLM2-135M (the model we ship), bf16, LoRA stacks of rank 16 and 64
(the engine's default and largest fused rank), decode batches of 1 and 64, a 64-token prefill chunk.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator

import pytest
import torch

from engine.config import ModelArch
from engine.lora import PROJECTION_GROUPS

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels themselves (tests/gpu)"),
]

if importlib.util.find_spec("triton") is not None:
    from engine import (
        kernels_attention,
        kernels_elementwise,
        kernels_expand,
        kernels_fused,
        kernels_gemm_lora,
        kernels_gemm_lora_few,
        kernels_shrink,
        kernels_shrink_fused,
    )
    from engine.lora_plan import plan_segments
    from tests.support.compile_only import H200, CompiledLaunch, compile_only

META = torch.device("meta")
BF16 = torch.bfloat16
SLOTS = 8
ARCHS = {
    "llama7b": ModelArch("llama", 32000, 4096, 11008, 32, 32, 32, 128, 1e4, 1e-5, 4096, False, False),
    "smollm2": ModelArch("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e5, 1e-5, 2048, True, False),
}
RANKS = [16, 64]


def empty(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def group_shape(arch: ModelArch, group: str) -> tuple[int, tuple[int, ...]]:
    """(fan-in, output width of each member) of a projection group, as the engine's stacks hold it."""
    shapes = arch.projection_shapes()
    members = PROJECTION_GROUPS[group]
    return shapes[members[0]][0], tuple(shapes[m][1] for m in members)


def stacks(slices: int, rank: int, fan_in: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused group's A `[S, L*R, K]` and its rank-major B seen as `[S, N, R]`, as `LoRAStacks` passes them."""
    return empty(SLOTS, slices * rank, fan_in), empty(SLOTS, rank, width).transpose(-1, -2)


def slot_table() -> tuple[torch.Tensor, torch.Tensor]:
    return empty(SLOTS, dtype=torch.int32), empty(SLOTS, dtype=torch.float32)


def launch_gemm(arch: str, group: str, rank: int, tokens: int, few: bool = False) -> None:
    """One LoRA GEMM launch (the few-adapter one if `few`) of `tokens` rows over a projection group's stacks,
    on meta operands as the engine passes them."""
    fan_in, sizes = group_shape(ARCHS[arch], group)
    a, b = stacks(len(sizes), rank, fan_in, sum(sizes))
    ranks, scalings = slot_table()
    x, w, slots = empty(tokens, fan_in), empty(sum(sizes), fan_in), empty(tokens, dtype=torch.int32)
    if few:
        listed = empty(kernels_gemm_lora_few.capacity(rank), dtype=torch.int32)
        sync = empty(kernels_gemm_lora_few.SYNC_WORDS, dtype=torch.int32)
        kernels_gemm_lora_few.gemm_lora_few(x, w, None, a, b, ranks, scalings, slots, listed, sync, slice_sizes=sizes)
    else:
        kernels_gemm_lora.gemm_lora(x, w, None, a, b, ranks, scalings, slots, slice_sizes=sizes)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CompiledLaunch]]:
    with compile_only(H200, monkeypatch) as compiled:
        yield compiled


def assert_fit(launches: list[CompiledLaunch], *kernels: str) -> None:
    """Each named kernel was launched (and so compiled), and no program needs more shared memory than an SM
    gives one block."""
    assert sorted({c.kernel for c in launches}) == sorted(kernels)
    for c in launches:
        assert c.shared <= H200.shared_memory_per_block, (c.kernel, c.constants, c.shared)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("group", PROJECTION_GROUPS)
@pytest.mark.parametrize("tokens", [1, 64, 72, 128])  # 72 and 128: a decode batch of 64 with a joiner's rows
def test_lora_gemm(launches: list[CompiledLaunch], arch: str, rank: int, group: str, tokens: int) -> None:
    _, sizes = group_shape(ARCHS[arch], group)
    if not kernels_gemm_lora.fits(sizes, rank):
        pytest.skip(f"{arch} {group}: the engine runs the separate kernels (no common column tile)")
    launch_gemm(arch, group, rank, tokens)
    assert_fit(launches, "_gemm_lora_kernel")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("group", PROJECTION_GROUPS)
@pytest.mark.parametrize("tokens", [64, 512], ids=["decode", "prefill"])
def test_shrink_and_expand(launches: list[CompiledLaunch], arch: str, rank: int, group: str, tokens: int) -> None:
    fan_in, sizes = group_shape(ARCHS[arch], group)
    a, b = stacks(len(sizes), rank, fan_in, sum(sizes))
    ranks, scalings = slot_table()
    plan = plan_segments([t % SLOTS for t in range(tokens)], META)  # chunks of 1 (decode) or 64 (prefill)
    h = empty(tokens, len(sizes) * rank, dtype=torch.float32)
    kernels_shrink.shrink(empty(tokens, fan_in), a, ranks, plan, h, num_slices=len(sizes))
    kernels_expand.expand(empty(tokens, sum(sizes)), h, b, ranks, scalings, plan, slice_sizes=sizes)
    assert_fit(launches, "_shrink_kernel", "_expand_kernel")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rank", RANKS)
def test_shrinks_folded_into_norm_and_silu(launches: list[CompiledLaunch], arch: str, rank: int) -> None:
    spec, tokens = ARCHS[arch], 64
    hidden, inter = spec.hidden_size, spec.intermediate_size
    slots = empty(tokens, dtype=torch.int32)
    ranks, _ = slot_table()
    for group in ("qkv", "gate_up"):
        a, _ = stacks(len(PROJECTION_GROUPS[group]), rank, hidden, 1)
        h = empty(tokens, a.shape[1], dtype=torch.float32)
        x, pending, weight = empty(tokens, hidden), empty(tokens, hidden), empty(hidden)
        kernels_shrink_fused.add_rms_norm_shrink(
            x, pending, weight, 1e-5, a, ranks, slots, h, num_slices=a.shape[1] // rank
        )
    a_down, _ = stacks(1, rank, inter, 1)
    h = empty(tokens, rank, dtype=torch.float32)
    kernels_shrink_fused.silu_and_mul_shrink(empty(tokens, 2 * inter), a_down, ranks, slots, h)
    assert_fit(launches, "_add_rms_norm_shrink_kernel", "_silu_and_mul_shrink_kernel")


@pytest.mark.parametrize("arch", ARCHS)
def test_elementwise(launches: list[CompiledLaunch], arch: str) -> None:
    spec, tokens = ARCHS[arch], 64
    x = empty(tokens, spec.hidden_size)
    kernels_elementwise.add_rms_norm(x, empty(tokens, spec.hidden_size), empty(spec.hidden_size), 1e-5)
    kernels_elementwise.silu_and_mul(empty(tokens, 2 * spec.intermediate_size))
    assert_fit(launches, "_add_rms_norm_kernel", "_silu_and_mul_kernel")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("tokens", "max_len"), [(64, 512), (1, 4096)], ids=["batch64-kv512", "batch1-kv4096"])
def test_attention(launches: list[CompiledLaunch], arch: str, tokens: int, max_len: int) -> None:
    """Rotary with the cache write (decode, and a prefill that also keeps its keys), then attention: one range
    of keys per row at batch 64, several merged at batch 1."""
    spec = ARCHS[arch]
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    k_cache, v_cache = empty(SLOTS, kv_heads, max_len, dim), empty(SLOTS, kv_heads, max_len, dim)
    slots, positions = empty(tokens, dtype=torch.int32), empty(tokens, dtype=torch.int32)
    qkv, cos, sin = empty(tokens, (heads + 2 * kv_heads) * dim), empty(tokens, dim), empty(tokens, dim)
    q = kernels_attention.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, positions, heads, kv_heads)
    kv_out = empty(tokens, 2 * kv_heads, dim)
    kernels_attention.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots[:1], positions, heads, kv_heads, kv_out)
    kernels_attention.decode_attention(q, k_cache, v_cache, slots, positions, max_len)
    merged = kernels_attention.split_count(tokens, kv_heads, max_len, META) > 1
    expected = ["_rope_cache_kernel", "_decode_attention_kernel"] + (["_merge_splits_kernel"] if merged else [])
    assert_fit(launches, *expected)


@pytest.mark.parametrize("rank", RANKS)
def test_one_launch_lora(launches: list[CompiledLaunch], rank: int) -> None:
    """`kernels_fused.fused`, the one-launch shrink and expand (not the default), at Llama-7B's q/k/v."""
    fan_in, sizes = group_shape(ARCHS["llama7b"], "qkv")
    a, b = stacks(len(sizes), rank, fan_in, sum(sizes))
    ranks, scalings = slot_table()
    plan = plan_segments(list(range(SLOTS)) * 8, META)
    kernels_fused.fused(empty(64, sum(sizes)), empty(64, fan_in), a, b, ranks, scalings, plan, slice_sizes=sizes)
    assert_fit(launches, "_fused_kernel")


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("tokens", [64, 128])
def test_lora_gemm_keeps_its_registers(launches: list[CompiledLaunch], rank: int, tokens: int) -> None:
    """The one-adapter GEMM of a Llama-7B decode step (its hot path: 144-210 registers a thread) spills none
    to local memory, which would put memory traffic inside the loop that streams the weights; nor does its
    tile of 128 rows (8 warps)."""
    launch_gemm("llama7b", "qkv", rank, tokens)
    (launch,) = launches
    registers, spilled = launch.registers()
    assert spilled == 0, f"{spilled} bytes spilled at {registers} registers a thread"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rank", [16, 32, 64])
@pytest.mark.parametrize("group", PROJECTION_GROUPS)
@pytest.mark.parametrize("tokens", [64, 72])
def test_lora_gemm_of_few_adapters(
    launches: list[CompiledLaunch], arch: str, rank: int, group: str, tokens: int
) -> None:
    """The few-adapter GEMM (shrink programs beside the GEMM's in one launch) compiles at the engine's shapes,
    fits an SM's shared memory and spills no register."""
    _, sizes = group_shape(ARCHS[arch], group)
    if not kernels_gemm_lora_few.fits(sizes, rank):
        pytest.skip(f"{arch} {group}: the engine runs the separate kernels (no common column tile)")
    launch_gemm(arch, group, rank, tokens, few=True)
    assert_fit(launches, "_gemm_lora_few_kernel")
    (launch,) = launches
    registers, spilled = launch.registers()
    print(arch, group, rank, tokens, "regs", registers, "shared", launch.shared, "stages", launch.num_stages)
    assert spilled == 0, f"{spilled} bytes spilled at {registers} registers a thread"


def global_loads_of_two_bytes(launch: CompiledLaunch) -> int:
    """`ld.global` instructions of one bf16 each in a launch's PTX (its code, not the debug sections after)."""
    code = launch.ptx.split("\n.section")[0]
    return len(re.findall(r"ld\.global(?:\.\w+)*\.b16\s", code))


@pytest.mark.parametrize("few", [False, True])
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("group", PROJECTION_GROUPS)
def test_lora_gemms_read_b_sixteen_bytes_at_a_time(
    launches: list[CompiledLaunch], few: bool, rank: int, group: str
) -> None:
    """Both LoRA GEMMs load B's rank-major rows in 16-byte vectors, not element by element. B's column stride
    was once passed in as an argument: equal to 1, but annotated `int`, which keeps triton from specialising it,
    so the compiled code read 2 bytes a load (16-128 loads a thread, found in the PTX, bench/RESULTS-gpu.md
    stops 30 and 31)."""
    launch_gemm("llama7b", group, rank, 64, few)
    (launch,) = launches
    assert global_loads_of_two_bytes(launch) == 0
