"""A tiny Llama-shaped architecture and random PEFT adapter files for fast engine unit tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import ModelArch

TINY = ModelArch(
    arch="llama",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=64,
    tie_embeddings=True,
    qkv_bias=False,
)


def write_adapter(
    folder: Path,
    arch: ModelArch = TINY,
    rank: int = 4,
    alpha: float = 8.0,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    config_overrides: dict[str, object] | None = None,
    shape_override: dict[str, list[int]] | None = None,
    device: str = "cpu",
) -> Path:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with random A and B, drawn on
    `device` (a GPU draws a large model's adapters far faster than a CPU)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    shapes = arch.projection_shapes()
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        for module in modules:
            fan_in, fan_out = shapes[module]
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            a_shape = (shape_override or {}).get("A", [rank, fan_in])
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(*a_shape, generator=gen, device=device) * 0.1).cpu()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen, device=device) * 0.1).cpu()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config: dict[str, object] = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(modules),
        "bias": "none",
        "use_rslora": False,
    }
    config.update(config_overrides or {})
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
