"""The engine's own decoder layers (`engine.model.DecoderModel` with `engine.lora`'s stacks and step batch) at
Llama-7B dimensions: decode batch 64, KV length 512, bf16, triton attention, CUDA graphs; rank 16 on all seven
projections. Run on a CUDA machine: `PYTHONPATH=. python3 bench/engine_layer_gpu.py [--layers 4]`.

Per mix (no LoRA, one adapter for all rows, 8 adapters x 8 rows, 64 distinct adapters) and per LoRA shrink mode
(folded into the norm and SiLU kernels, `engine/kernels_shrink_fused.py`, or separate kernels), side by side
in one run:
- time per layer of a replayed graph of `--layers` layers (embedding and a 1024-token vocabulary included);
- throughput against no LoRA, next to the bandwidth bound base bytes / (base bytes + adapter bytes);
- LoRA's added time per layer (mix minus no LoRA), the figure goal (a) bounds for the LoRA kernels alone;
- folded over separate.
The two modes' logits are checked against each other first. Times: medians of `triton.testing.do_bench`.
"""

from __future__ import annotations

import argparse

import torch
from engine_gpu import BATCH, DEV, DTYPE, KV_LEN, RANK, SLOTS, capture, median_us  # a sibling script

from engine.config import ModelArch
from engine.kv_cache import KVCache
from engine.lora import AdapterWeights, LoRABatch, LoRAStacks
from engine.lora_plan import chunk_capacity, plan_segments
from engine.model import DecoderModel, DecodeView

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIXES = {
    "one adapter": [0] * BATCH,
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

    def use(mix: list[int]) -> None:
        token_slots.copy_(torch.tensor(mix, dtype=torch.int32))
        plan.copy_(plan_segments(mix, DEV, block_m=1, num_chunks=capacity))

    base_graph, _ = capture(lambda: model.decode(ids, view, kv, None))
    graphs = {}
    for fold in (True, False):
        stacks.fold_shrinks = fold  # read while the forward is captured
        graphs[fold] = capture(lambda: model.decode(ids, view, kv, LoRABatch.static(stacks, token_slots, plan)))
    for name, mix in MIXES.items():
        use(mix)
        outs = {}
        for fold, (graph, out) in graphs.items():
            graph.replay()
            outs[fold] = out.float().clone()
        err = float((outs[True] - outs[False]).norm() / outs[False].norm())
        print(f"check {name}: folded vs separate shrinks, rel err of the logits {err:.2e}", flush=True)
        if err > 2e-2:
            raise AssertionError("folded and separate shrinks disagree")
    layers = spec.num_layers
    base = median_us(base_graph.replay, quick=False) / layers
    summary = [f"no LoRA: {base:.1f} us per layer (Llama-7B dims, batch {BATCH}, KV {KV_LEN}, graphs)"]
    for name, mix in MIXES.items():
        use(mix)
        times = {fold: median_us(graph.replay, quick=False) / layers for fold, (graph, _) in graphs.items()}
        distinct = len(set(mix))
        bound = base_bytes(spec) / (base_bytes(spec) + distinct * adapter_bytes(spec))
        for fold, t in times.items():
            mode = "folded shrinks" if fold else "separate shrinks"
            summary.append(
                f"{name:11s} {mode:16s}: {t:6.1f} us per layer, x{base / t:.3f} of no LoRA's throughput "
                f"(bandwidth bound x{bound:.3f}); LoRA adds {t - base:5.1f} us per layer"
            )
        summary.append(f"{name:11s} folded / separate: x{times[False] / times[True]:.3f} throughput")
    print("\n== summary ==")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
