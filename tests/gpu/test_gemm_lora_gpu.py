"""The compiled LoRA-inside-the-GEMM kernel (`engine.kernels_gemm_lora`) on a CUDA GPU against its torch reference,
at Llama-7B and SmolLM2 projection shapes, decode batch 64 in bf16, one adapter of rank 8, 16 or 64 (a rank-64
stack) beside base rows; also 72 and 128 rows (a decode batch of 64 with a joiner's rows: one tile of 128
rows on 8 warps). The few-adapter GEMM (`engine.kernels_gemm_lora_few`) likewise, and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from engine.kernels_gemm_lora import gemm_lora, reference_gemm_lora
from engine.kernels_gemm_lora_few import SYNC_WORDS, capacity, gemm_lora_few, reference_gemm_lora_few, workspace_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {  # (input width, slices)
    "llama-qkv": (4096, [4096, 4096, 4096]),
    "llama-o": (4096, [4096]),
    "llama-down": (11008, [4096]),
    "llama-gate-up": (4096, [11008, 11008]),
    "smollm2-qkv": (576, [576, 192, 192]),
    "smollm2-down": (1536, [576]),
}
RANKS = [16, 8, 64, 0]  # a rank-64 stack


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("slot", [0, 1, 2], ids=["rank-16", "rank-8", "rank-64"])
@pytest.mark.parametrize("rows", [64, 72, 128])
def test_gemm_lora_matches_torch(shape: str, slot: int, rows: int) -> None:
    k, sizes = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, r = sum(sizes), max(RANKS)

    def rand(*dims: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*dims, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    x, w = rand(rows, k), rand(n, k, scale=k**-0.5)
    a_stack = rand(len(RANKS), len(sizes) * r, k, scale=k**-0.5)
    b_stack = rand(len(RANKS), r, n, scale=0.5).transpose(1, 2)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device="cuda")
    scalings = torch.tensor([0.5, 2.0, 1.0, 1.0], device="cuda")
    slots = torch.tensor([-1 if t % 5 == 0 else slot for t in range(rows)], dtype=torch.int32, device="cuda")
    args = (x, w, None, a_stack, b_stack, ranks, scalings)
    got = gemm_lora(*args, slots, slice_sizes=sizes)
    want = reference_gemm_lora(*args, slots, slice_sizes=sizes)
    assert rel_err(got, want) < 1e-2
    plain = reference_gemm_lora(*args, torch.full_like(slots, -1), slice_sizes=sizes)
    assert rel_err(want, plain) > 5e-2  # the delta is large enough for the check to mean something


def test_split_k_in_a_cuda_graph_repeats_bit_for_bit() -> None:
    """Llama-7B's o projection splits K in two (`tiling`): three launches captured in one graph, replayed
    twice, give the eager launches' bits, so every tile's arrival count was back at zero each time."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(64, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    ws = [(torch.randn(4096, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16) for _ in range(3)]
    a_stack = (torch.randn(1, 16, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    b_stack = torch.randn(1, 16, 4096, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
    ranks, scalings = torch.tensor([16], dtype=torch.int32, device="cuda"), torch.ones(1, device="cuda")
    slots = torch.zeros(64, dtype=torch.int32, device="cuda")

    def three() -> list[torch.Tensor]:
        return [gemm_lora(x, w, None, a_stack, b_stack, ranks, scalings, slots, slice_sizes=[4096]) for w in ws]

    eager = three()
    want = reference_gemm_lora(x, ws[0], None, a_stack, b_stack, ranks, scalings, slots, slice_sizes=[4096])
    assert rel_err(eager[0], want) < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        three()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = three()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(got, e) for got, e in zip(captured, eager, strict=True))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("r_stack", [16, 64])
@pytest.mark.parametrize("rows", [64, 72, 128])
def test_few_adapter_gemm_matches_torch(shape: str, r_stack: int, rows: int) -> None:
    """`gemm_lora_few` with as many adapters as the stack's rank allows (8 at 16, 2 at 64; ranks full, 8 and
    0 among them), listed out of slot order, base rows beside them; twice, as its counters must return to
    zero."""
    k, sizes = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(2)
    n, cap = sum(sizes), capacity(r_stack)
    slot_ranks = [r_stack, 8, 0] + [r_stack] * (cap - 3) if cap > 2 else [r_stack, 8]

    def rand(*dims: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*dims, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    x, w = rand(rows, k), rand(n, k, scale=k**-0.5)
    a_stack = rand(cap, len(sizes) * r_stack, k, scale=k**-0.5)
    b_stack = rand(cap, r_stack, n, scale=0.5).transpose(1, 2)
    ranks = torch.tensor(slot_ranks, dtype=torch.int32, device="cuda")
    scalings = torch.linspace(0.5, 2.0, cap, device="cuda")
    slots = torch.tensor([-1 if t % 5 == 0 else t % cap for t in range(rows)], dtype=torch.int32, device="cuda")
    listed = torch.tensor(list(range(cap))[::-1], dtype=torch.int32, device="cuda")
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device="cuda")
    args = (x, w, None, a_stack, b_stack, ranks, scalings, slots, listed)
    want = reference_gemm_lora_few(*args, slice_sizes=sizes)
    plain = reference_gemm_lora_few(*args[:-1], torch.full_like(listed, -1), slice_sizes=sizes)
    assert rel_err(want, plain) > 5e-2  # the delta is large enough for the check to mean something
    for _ in range(2):
        got = gemm_lora_few(*args, sync, slice_sizes=sizes)
        torch.cuda.synchronize()
        assert rel_err(got, want) < 1e-2
        assert sync.tolist() == [0] * SYNC_WORDS


def test_few_adapter_gemms_in_a_cuda_graph_repeat_bit_for_bit() -> None:
    """Llama-7B's q/k/v and o (K split in two) as few-adapter GEMMs, one after another with PDL as a layer runs
    them, captured in one graph and replayed with the list and rows refilled: each replay gives the eager
    launches' bits for its own adapters."""
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rand(*dims: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*dims, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    x = rand(64, 4096)
    shapes = [[4096] * 3, [4096], [4096] * 3, [4096]]
    ws = [rand(sum(s), 4096, scale=1 / 64) for s in shapes]
    stacks = [(rand(8, 16 * len(s), 4096, scale=1 / 64), rand(8, 16, sum(s)).transpose(1, 2)) for s in shapes]
    ranks, scalings = torch.full((8,), 16, dtype=torch.int32, device="cuda"), torch.ones(8, device="cuda")
    slots = torch.zeros(64, dtype=torch.int32, device="cuda")
    listed = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    syncs = torch.zeros(len(shapes), SYNC_WORDS, dtype=torch.int32, device="cuda")
    hx = torch.empty(workspace_rows(64), 3 * 128, dtype=torch.float32, device="cuda")

    def chain() -> list[torch.Tensor]:
        outs, h = [], x
        for i, (w, (a, b), s) in enumerate(zip(ws, stacks, shapes, strict=True)):
            out = gemm_lora_few(h, w, None, a, b, ranks, scalings, slots, listed, syncs[i], hx, slice_sizes=s)
            outs.append(out)
            h = out[:, :4096].contiguous()
        return outs

    def use(mix: list[int]) -> None:
        slots.copy_(torch.tensor(mix, dtype=torch.int32))
        used = sorted(set(mix))
        listed.copy_(torch.tensor(used + [-1] * (8 - len(used)), dtype=torch.int32))

    mixes = [[t // 8 for t in range(64)], [(t % 3) * 2 for t in range(64)]]
    eager = []
    for mix in mixes:
        use(mix)
        eager.append([o.clone() for o in chain()])
    first = reference_gemm_lora_few(x, ws[0], None, *stacks[0], ranks, scalings, slots, listed, slice_sizes=shapes[0])
    assert rel_err(eager[-1][0], first) < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(2):
        for mix, want in zip(mixes, eager, strict=True):
            use(mix)
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(got, e) for got, e in zip(captured, want, strict=True))
    assert not syncs.any()
