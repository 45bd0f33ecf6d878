"""Random-weight Llama-family models saved as Hugging Face folders, for GPU runs where no weights can be
downloaded (the tokenizer folder is passed in: a copy of the converted SmolLM2 tokenizer)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TypedDict

import torch
from safetensors.torch import save_file


# Shapes a GPU benchmark can ask for (`write_random_llama(..., **SHAPES[name])`). Llama-7B's keeps SmolLM2's
# vocabulary, so the tokenizer folder passed in fits it; its own is 32000 words, which changes only the LM head.
class ModelShape(TypedDict):
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    vocab: int


SHAPES: dict[str, ModelShape] = {
    "smollm2": ModelShape(hidden=576, inter=1536, heads=9, kv_heads=3, vocab=49152),
    "llama-7b": ModelShape(hidden=4096, inter=11008, heads=32, kv_heads=32, vocab=49152),
}


def write_random_llama(
    folder: Path,
    tokenizer: Path,
    layers: int,
    *,
    hidden: int = 576,
    inter: int = 1536,
    heads: int = 9,
    kv_heads: int = 3,
    vocab: int = 49152,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Path:
    """A SmolLM2-135M-shaped model by default (tied embeddings), weights scaled to keep activations sane and
    saved as `dtype` (bfloat16 halves a large shape's file: Llama-7B's is 13 GB so). `device` draws the
    random numbers (a CPU draws Llama-7B's in minutes, a GPU in well under a second)."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    state = {
        "model.embed_tokens.weight": (randn(vocab, hidden) * 0.05).to(dtype).cpu(),
        "model.norm.weight": torch.ones(hidden, dtype=dtype),
    }
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    for layer in range(layers):
        p = f"model.layers.{layer}."
        state[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        state[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        for name, shape in shapes.items():  # cast one at a time: a large shape's float32 copy need not fit
            state[p + name + ".weight"] = (randn(*shape) / shape[1] ** 0.5).to(dtype).cpu()
    config = dict(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def write_tiny_llama(folder: Path) -> Path:
    """A random Llama of `tests.unit.engine.tiny.TINY`'s shape (so `write_adapter`'s adapters fit it), with a
    128-word tokenizer of its own (no tokenizer files needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.unit.engine.tiny import TINY

    words = folder / "tokenizer"
    words.mkdir(parents=True)
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, TINY.vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(words / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}
    (words / "tokenizer_config.json").write_text(json.dumps(config))
    return write_random_llama(
        folder / "model",
        words,
        layers=TINY.num_layers,
        hidden=TINY.hidden_size,
        inter=TINY.intermediate_size,
        heads=TINY.num_heads,
        kv_heads=TINY.num_kv_heads,
        vocab=TINY.vocab_size,
    )
