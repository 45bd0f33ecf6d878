"""The engine's own decoder layers (`engine.model.DecoderModel` with `engine.lora`'s stacks and step batch) at
Llama-7B dimensions: decode batch 64, KV length 512, bf16, triton attention, CUDA graphs; rank 16 on all seven
projections. Run on a CUDA machine: `PYTHONPATH=. python3 bench/engine_layer_gpu.py [--layers 4]`.

Per mix (no LoRA, one adapter for all rows, 8 adapters x 8 rows, 64 distinct adapters) and per LoRA mode, side
by side in one run. Modes: the base GEMMs (cuBLAS) then separate shrink and expand kernels; the shrinks folded
into the norm and SiLU kernels (`engine/kernels_shrink_fused.py`); each projection one triton GEMM with its
LoRA inside (`engine/kernels_gemm_lora.py`) for one adapter; both of the last two; and the same GEMM for one
adapter with the few-adapter GEMM (`engine/kernels_gemm_lora_few.py`) for 2 to 8. Figures:
- time per layer of a replayed graph of `--layers` layers (embedding and a 1024-token vocabulary included);
- throughput against no LoRA, next to the bandwidth bound base bytes / (base bytes + adapter bytes);
- LoRA's added time per layer (mix minus no LoRA), the figure goal (a) bounds for the LoRA kernels alone;
- each mode over the separate kernels.
Every mode's logits are checked against the separate kernels' first, and the LoRA must visibly change them.
Times: medians of `triton.testing.do_bench`.
"""

from __future__ import annotations

import argparse
import functools

import torch
from engine_gpu import BATCH, DEV, DTYPE, KV_LEN, RANK, SLOTS, capture, median_us  # a sibling script

from engine import kernels_gemm_lora_few
from engine.config import ModelArch
from engine.kv_cache import KVCache
from engine.lora import AdapterWeights, LoRAStacks
from engine.lora_batch import LoRABatch
from engine.lora_plan import chunk_capacity, plan_segments
from engine.model import DecoderModel, DecodeView

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIXES = {
    "one adapter": [0] * BATCH,
    "4 x 16": [i // 16 for i in range(BATCH)],
    "8 x 8": [i // 8 for i in range(BATCH)],
    "64 distinct": list(range(BATCH)),
}


def llama_7b(layers: int) -> ModelArch:
    return ModelArch(
        arch="llama",
        vocab_size=1024,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=layers,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position=2 * KV_LEN,
        tie_embeddings=True,
        qkv_bias=False,
    )


def random_model(spec: ModelArch) -> DecoderModel:
    with torch.device(DEV):
        model = DecoderModel(spec).to(DTYPE).eval()
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, param.shape[-1] ** -0.5)
    model.use_triton_attention(True)
    return model


def random_adapter(spec: ModelArch, seed: int) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module, (fan_in, fan_out) in spec.projection_shapes().items():
            a = torch.randn(RANK, fan_in, generator=gen) / fan_in**0.5
            tensors[(layer, module)] = (a.to(DTYPE), (torch.randn(fan_out, RANK, generator=gen) / RANK**0.5).to(DTYPE))
    return AdapterWeights(RANK, 1.0, frozenset(MODULES), tensors)


def adapter_bytes(spec: ModelArch) -> int:
    """One rank-16 adapter's bytes per layer (A and B of the seven projections)."""
    return sum(RANK * (fan_in + fan_out) * 2 for fan_in, fan_out in spec.projection_shapes().values())


def base_bytes(spec: ModelArch) -> int:
    """A layer's weight bytes and the keys and values its decode step reads."""
    h, i, kv = spec.hidden_size, spec.intermediate_size, spec.kv_size
    weights = (h * (spec.q_size + 2 * kv) + h * spec.q_size + 3 * h * i) * 2
    return weights + 2 * BATCH * KV_LEN * kv * 2


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=4, help="layers per graph")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    spec = llama_7b(args.layers)
    model = random_model(spec)
    kv = KVCache(spec, BATCH, KV_LEN, DTYPE, DEV)
    for layer in range(spec.num_layers):
        kv.k[layer].normal_()
        kv.v[layer].normal_()
    stacks = LoRAStacks(spec, SLOTS, RANK, DTYPE, DEV)
    for slot in range(SLOTS):
        stacks.set_lora(slot, random_adapter(spec, slot))
    torch.cuda.synchronize()
    ids = torch.randint(0, spec.vocab_size, (BATCH,), device=DEV)
    view = DecodeView.of_buffers(torch.arange(BATCH, device=DEV), torch.full((BATCH,), KV_LEN - 1, device=DEV), KV_LEN)
    token_slots = torch.zeros(BATCH, dtype=torch.int32, device=DEV)
    capacity = chunk_capacity(BATCH, SLOTS, 1)
    plan = plan_segments([0] * BATCH, DEV, block_m=1, num_chunks=capacity)

    few_capacity = kernels_gemm_lora_few.capacity(RANK)
    listed = torch.full((few_capacity,), -1, dtype=torch.int32, device=DEV)

    def use(mix: list[int]) -> None:
        token_slots.copy_(torch.tensor(mix, dtype=torch.int32))
        plan.copy_(plan_segments(mix, DEV, block_m=1, num_chunks=capacity))
        used = sorted(set(mix))[:few_capacity]
        listed.copy_(torch.tensor(used + [-1] * (few_capacity - len(used)), dtype=torch.int32))

    base_graph, base_out = capture(lambda: model.decode(ids, view, kv, None))
    base_graph.replay()  # its logits, for the checks below
    # (fold_shrinks, lora_gemm, lora_gemm_few)
    modes = {
        "separate": (False, False, False),
        "folded": (True, False, False),
        "gemm": (False, True, False),
        "gemm + folded": (True, True, False),
        "gemm + few": (False, True, True),
    }

    def decode(kind: str) -> torch.Tensor:
        # The step's batch is made inside the captured forward: its workspace is zeroed by every replay.
        few = listed if kind == "few" else None
        return model.decode(ids, view, kv, LoRABatch.static(stacks, token_slots, plan, kind == "single", few))

    graphs = {}
    for mode, (fold, gemm, few) in modes.items():
        for kind in ("any", "single", "few") if few else ("any", "single") if gemm else ("any",):
            # Read while the forward is captured.
            stacks.fold_shrinks, stacks.lora_gemm, stacks.lora_gemm_few = fold, gemm, few
            graphs[(mode, kind)] = capture(functools.partial(decode, kind))

    def graph_of(mode: str, mix: list[int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The mode's graph for this mix, as the engine picks: the GEMM modes have one for a batch of one adapter,
        the few-adapter mode one for batches of 2 to `few_capacity`."""
        distinct = len(set(mix))
        kind = "single" if distinct == 1 else "few" if distinct <= few_capacity else "any"
        return graphs.get((mode, kind), graphs[(mode, "any")])

    for name, mix in MIXES.items():
        use(mix)
        outs = {}
        for mode in modes:
            graph, out = graph_of(mode, mix)
            graph.replay()
            outs[mode] = out.float().clone()
        for mode in list(modes)[1:]:
            # bf16 rounds differently per mode (the GEMM rounds base + delta once, the separate kernels twice):
            # the modes must agree far better than LoRA changes the logits.
            err = float((outs[mode] - outs["separate"]).norm() / outs["separate"].norm())
            effect = float((outs["separate"] - base_out.float()).norm() / outs["separate"].norm())
            print(
                f"check {name}: {mode} vs separate kernels, rel err of the logits {err:.2e} "
                f"(LoRA's own effect on them {effect:.2e})",
                flush=True,
            )
            if err > 0.25 * effect:
                raise AssertionError(f"{mode} and the separate kernels disagree")
            # Rank-16 adapters at scaling 1 move the logits by tens of percent: with no effect at all, every mode
            # would agree with the others (err 0 <= 0) while timing a LoRA path that does nothing.
            if effect < 1e-2:
                raise AssertionError(f"{name}: the LoRA did not change the logits ({effect:.2e})")
    layers = spec.num_layers
    base = median_us(base_graph.replay, quick=False) / layers
    summary = [f"no LoRA: {base:.1f} us per layer (Llama-7B dims, batch {BATCH}, KV {KV_LEN}, graphs)"]
    for name, mix in MIXES.items():
        use(mix)
        times = {mode: median_us(graph_of(mode, mix)[0].replay, quick=False) / layers for mode in modes}
        distinct = len(set(mix))
        bound = base_bytes(spec) / (base_bytes(spec) + distinct * adapter_bytes(spec))
        for mode, t in times.items():
            summary.append(
                f"{name:11s} {mode:13s}: {t:6.1f} us per layer, x{base / t:.3f} of no LoRA's throughput "
                f"(bandwidth bound x{bound:.3f}); LoRA adds {t - base:5.1f} us per layer"
            )
        ratios = ", ".join(f"{mode} x{times['separate'] / t:.3f}" for mode, t in times.items() if mode != "separate")
        summary.append(f"{name:11s} throughput over the separate kernels: {ratios}")
    print("\n== summary ==")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
