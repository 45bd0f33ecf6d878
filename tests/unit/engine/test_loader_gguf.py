"""GGUF metadata the loader must honour or refuse, on tiny float32 files written with the gguf package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.loader import load_weights, resolve_model

gguf = pytest.importorskip("gguf")

VOCAB, HIDDEN, INTER, HEADS, KV_HEADS = 96, 32, 64, 4, 2


def write_tiny_gguf(
    path: Path, metadata: dict[str, str | int | float] | None = None, extra_tensors: tuple[str, ...] = ()
) -> Path:
    """A 2-layer Llama GGUF with random float32 weights; `metadata` adds llama.* keys (int, float or str)."""
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(f"llama.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"llama.{key}", value)
        else:
            writer.add_float32(f"llama.{key}", value)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32) * 0.1)

    tensor("token_embd.weight", VOCAB, HIDDEN)
    tensor("output_norm.weight", HIDDEN)
    for i in range(2):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", INTER, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, INTER)
    for name in extra_tensors:
        tensor(name, head_dim // 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTERGATE_CACHE", str(tmp_path / "cache"))


def test_tiny_gguf_loads(tmp_path: Path) -> None:
    arch, state = load_weights(resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf"))))
    assert (arch.vocab_size, arch.num_layers, arch.head_dim, arch.max_position) == (VOCAB, 2, HIDDEN // HEADS, 64)
    assert arch.tie_embeddings and tuple(state["embed"].shape) == (VOCAB, HIDDEN)


@pytest.mark.parametrize(
    ("metadata", "extra", "kind"),
    [
        ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, (), "linear"),
        ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, (), "yarn"),
        ({}, ("rope_freqs.weight",), "rope_freqs"),  # Llama 3.1's frequency factors
    ],
    ids=["linear", "yarn", "rope_freqs"],
)
def test_scaled_rope_is_refused(
    tmp_path: Path, metadata: dict[str, str | int | float], extra: tuple[str, ...], kind: str
) -> None:
    # Loading it with unscaled tables would give wrong logits at every position past the first.
    path = write_tiny_gguf(tmp_path / "scaled.gguf", metadata, extra)
    with pytest.raises(ValueError, match=f"unsupported rope scaling '{kind}'"):
        load_weights(resolve_model(str(path)))


def test_unscaled_rope_type_none_loads(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "none.gguf", {"rope.scaling.type": "none"})
    assert load_weights(resolve_model(str(path)))[0].max_position == 64


def test_sliding_window_caps_the_context(tmp_path: Path) -> None:
    # Attention has no window here: past it, every query would see keys the model never attends to.
    path = write_tiny_gguf(tmp_path / "window.gguf", {"attention.sliding_window": 16})
    assert load_weights(resolve_model(str(path)))[0].max_position == 16


def test_a_conversion_cached_by_an_older_loader_is_not_trusted(tmp_path: Path) -> None:
    # The dequantized copy was once trusted whatever loader made it: a file cached before rope scaling was
    # refused kept loading, with unscaled tables.
    import dataclasses
    import json

    from engine.loader import cache_dir

    path = write_tiny_gguf(tmp_path / "scaled.gguf", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0})
    source = resolve_model(str(path))
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        load_weights(source)
    arch, state = load_weights(resolve_model(str(write_tiny_gguf(tmp_path / "plain.gguf"))))
    old = cache_dir(source)  # what an older loader left: unversioned files
    old.mkdir(parents=True, exist_ok=True)
    (old / "arch.json").write_text(json.dumps(dataclasses.asdict(arch)))
    from safetensors.torch import save_file

    save_file(state, str(old / "weights.safetensors"))
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        load_weights(source)
