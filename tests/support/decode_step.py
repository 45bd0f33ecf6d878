"""One decode step through `DecoderModel` with the triton attention kernels against the torch path, shared by
the interpreted CPU test and the GPU test."""

from __future__ import annotations

import copy

import torch

from engine.config import ModelArch
from engine.kv_cache import KVCache
from engine.model import DecoderModel, DecodeView, PrefillView

# SmolLM2-135M's attention (9 query heads on 3 KV heads of 64), and Llama-7B's (32 heads of 128, no grouping):
# query heads, KV heads, head size, hidden size.
SHAPES = {"smollm2": (9, 3, 64, 576), "llama-7b": (32, 32, 128, 4096)}


def two_layer_arch(heads: int, kv_heads: int, head_dim: int, hidden: int) -> ModelArch:
    return ModelArch(
        arch="llama",
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position=4096,
        tie_embeddings=True,
        qkv_bias=False,
    )


def random_model(spec: ModelArch, gen: torch.Generator) -> DecoderModel:
    """fp32 on the CPU; weights scaled by 1/sqrt(fan-in), so activations stay of order one."""
    model = DecoderModel(spec)
    for name, param in model.named_parameters():
        param.data = torch.ones_like(param) if "norm" in name else torch.randn(param.shape, generator=gen)
        param.data /= 1 if "norm" in name else param.shape[-1] ** 0.5
    return model


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def compare_decode_step(shape: str, max_len: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """Logits of one decode step (16 rows at random slots and positions, among them 0 and max_len - 1) by the
    triton path and by the torch path, both in `dtype`, against the torch path in fp32 on the same inputs.
    Returns (triton's error, torch's error), relative. Also checks the caches the two paths wrote: the first
    layer's values equal, its keys within rounding (later layers see slightly different inputs)."""
    spec = two_layer_arch(*SHAPES[shape])
    gen = torch.Generator().manual_seed(0)
    model = random_model(spec, gen)
    truth_model = copy.deepcopy(model).to(device, torch.float32).eval()
    model = model.to(device, dtype).eval()
    batch, slots_total = 16, 20
    caches = {
        "triton": KVCache(spec, slots_total, max_len, dtype, device),
        "torch": KVCache(spec, slots_total, max_len, dtype, device),
        "truth": KVCache(spec, slots_total, max_len, torch.float32, device),
    }
    for layer in range(spec.num_layers):  # the same past in every cache, rounded to `dtype` first
        past = torch.randn(caches["truth"].k[layer].shape, generator=gen).to(dtype).to(device)
        for cache in caches.values():
            cache.k[layer].copy_(past)
            cache.v[layer].copy_(past.flip(-1))
    ids = torch.randint(0, spec.vocab_size, (batch,), generator=gen).to(device)
    slots = torch.randperm(slots_total, generator=gen)[:batch].to(device)
    positions = torch.randint(0, max_len, (batch,), generator=gen)
    positions[:3] = torch.tensor([0, max_len - 1, 63])
    view = DecodeView.of_buffers(slots, positions.to(device), max_len)
    logits = {}
    for kind, runner in (("triton", model), ("torch", model), ("truth", truth_model)):
        runner.use_triton_attention(kind == "triton")
        logits[kind] = runner.decode(ids, view, caches[kind], None).float()
    assert torch.equal(caches["triton"].v[0], caches["torch"].v[0])
    assert rel_err(caches["triton"].k[0], caches["torch"].k[0]) < (1e-6 if dtype == torch.float32 else 1e-2)
    return rel_err(logits["triton"], logits["truth"]), rel_err(logits["torch"], logits["truth"])


def replay_with_new_positions(shape: str, max_len: int, dtype: torch.dtype) -> float:
    """A CUDA graph of a triton decode step captured once, replayed after other slots and positions were written
    into its buffers, against the torch path run on those; returns the relative error of the logits."""
    spec = two_layer_arch(*SHAPES[shape])
    device = torch.device("cuda")
    model = random_model(spec, torch.Generator().manual_seed(1)).to(device, dtype).eval()
    gen = torch.Generator(device=device).manual_seed(1)
    batch, slots_total = 16, 20
    kv = {kind: KVCache(spec, slots_total, max_len, dtype, device) for kind in ("triton", "torch")}
    for layer in range(spec.num_layers):
        past = torch.randn(kv["torch"].k[layer].shape, generator=gen, device=device).to(dtype)
        for cache in kv.values():
            cache.k[layer].copy_(past)
            cache.v[layer].copy_(past.flip(-1))
    ids = torch.randint(0, spec.vocab_size, (batch,), generator=gen, device=device)
    slots = torch.randperm(slots_total, generator=gen, device=device)[:batch]
    positions = torch.randint(0, max_len, (batch,), generator=gen, device=device)
    view = DecodeView.of_buffers(slots, positions, max_len)
    for kind in ("torch", "triton"):  # the same writes in both caches; triton compiles outside the capture
        model.use_triton_attention(kind == "triton")
        model.decode(ids, view, kv[kind], None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.decode(ids, view, kv["triton"], None)
    new_slots = torch.randperm(slots_total, generator=gen, device=device)[:batch]
    new_positions = torch.randint(0, max_len, (batch,), generator=gen, device=device)
    slots.copy_(new_slots)
    positions.copy_(new_positions)
    graph.replay()
    model.use_triton_attention(False)
    want = model.decode(ids, DecodeView.of_buffers(new_slots, new_positions, max_len), kv["torch"], None)
    return rel_err(out.float(), want.float())


def compare_prefill(shape: str, length: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """Logits after prefilling one prompt of `length` tokens into slot 3 by the triton path and by the torch
    path, both in `dtype`, against the torch path in fp32; returns (triton's error, torch's error). Also checks
    the prompt's cache rows the two paths wrote, and that no other slot was written."""
    spec = two_layer_arch(*SHAPES[shape])
    gen = torch.Generator().manual_seed(2)
    model = random_model(spec, gen)
    truth_model = copy.deepcopy(model).to(device, torch.float32).eval()
    model = model.to(device, dtype).eval()
    caches = {
        "triton": KVCache(spec, 8, 512, dtype, device),
        "torch": KVCache(spec, 8, 512, dtype, device),
        "truth": KVCache(spec, 8, 512, torch.float32, device),
    }
    ids = torch.randint(0, spec.vocab_size, (length,), generator=gen).to(device)
    positions = torch.arange(length, device=device)
    view = PrefillView(slot=torch.tensor([3], device=device), last=torch.tensor([length - 1], device=device))
    logits = {}
    for kind, runner in (("triton", model), ("torch", model), ("truth", truth_model)):
        runner.use_triton_attention(kind == "triton")
        logits[kind] = runner.prefill(ids, positions, view, caches[kind], None).float()
    assert torch.equal(caches["triton"].v[0], caches["torch"].v[0])
    assert rel_err(caches["triton"].k[0], caches["torch"].k[0]) < (1e-6 if dtype == torch.float32 else 1e-2)
    others = [s for s in range(9) if s != 3]
    assert not caches["triton"].k[1][others].any() and not caches["triton"].v[1][others].any()
    return rel_err(logits["triton"], logits["truth"]), rel_err(logits["torch"], logits["truth"])
