"""One decode step through `DecoderModel` with the triton attention kernels against the torch path, shared by
the interpreted CPU test and the GPU test."""

from __future__ import annotations

import copy
from collections.abc import Callable

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


def assert_as_accurate_as_torch(errors: tuple[float, float], dtype: torch.dtype) -> None:
    """`errors` (triton's, torch's against fp32): in fp32 the two paths agree to rounding; in bf16 the kernels'
    error is the torch path's."""
    triton_err, torch_err = errors
    if dtype == torch.float32:
        assert triton_err < 1e-4
    else:
        assert triton_err < 1.5 * torch_err + 1e-3, errors


def _three_paths(
    shape: str, seed: int, dtype: torch.dtype, device: torch.device, slots: int, max_len: int
) -> tuple[ModelArch, torch.Generator, dict[str, DecoderModel], dict[str, KVCache]]:
    """One random model run three ways: triton and torch attention in `dtype`, and torch in fp32 (the
    truth), each with a KV cache of its own."""
    spec = two_layer_arch(*SHAPES[shape])
    gen = torch.Generator().manual_seed(seed)
    model = random_model(spec, gen)
    truth = copy.deepcopy(model).to(device, torch.float32).eval()
    model = model.to(device, dtype).eval()
    runners = {"triton": model, "torch": model, "truth": truth}
    caches = {
        kind: KVCache(spec, slots, max_len, torch.float32 if kind == "truth" else dtype, device) for kind in runners
    }
    return spec, gen, runners, caches


def _errors(
    runners: dict[str, DecoderModel],
    caches: dict[str, KVCache],
    dtype: torch.dtype,
    run: Callable[[DecoderModel, KVCache], torch.Tensor],
) -> tuple[float, float]:
    """Run each path; check the first layer's cache rows the triton and torch paths wrote (values equal, keys
    within rounding; later layers see slightly different inputs); (triton's, torch's) error of the logits."""
    logits = {}
    for kind, runner in runners.items():
        runner.use_triton_attention(kind == "triton")
        logits[kind] = run(runner, caches[kind]).float()
    assert torch.equal(caches["triton"].v[0], caches["torch"].v[0])
    assert rel_err(caches["triton"].k[0], caches["torch"].k[0]) < (1e-6 if dtype == torch.float32 else 1e-2)
    return rel_err(logits["triton"], logits["truth"]), rel_err(logits["torch"], logits["truth"])


def compare_decode_step(shape: str, max_len: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """Logits of one decode step (16 rows at random slots and positions, among them 0 and max_len - 1) by the
    triton path and by the torch path, both in `dtype`, against the torch path in fp32 on the same inputs.
    Returns (triton's error, torch's error), relative; checks the caches as `_errors` does."""
    batch, slots_total = 16, 20
    spec, gen, runners, caches = _three_paths(shape, 0, dtype, device, slots_total, max_len)
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
    return _errors(runners, caches, dtype, lambda model, kv: model.decode(ids, view, kv, None))


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
    spec, gen, runners, caches = _three_paths(shape, 2, dtype, device, 8, 512)
    ids = torch.randint(0, spec.vocab_size, (length,), generator=gen).to(device)
    positions = torch.arange(length, device=device)
    view = PrefillView(slot=torch.tensor([3], device=device), last=torch.tensor([length - 1], device=device))
    errors = _errors(runners, caches, dtype, lambda model, kv: model.prefill(ids, positions, view, kv, None))
    others = [s for s in range(9) if s != 3]
    assert not caches["triton"].k[1][others].any() and not caches["triton"].v[1][others].any()
    return errors
