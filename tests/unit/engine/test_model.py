"""Our decoder against transformers on tiny random Llama / Qwen2 / Mistral models saved as HF folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.kv_cache import KVCache
from engine.loader import load_weights, resolve_model
from engine.model import DecoderModel, DecodeView, PrefillView, SeqSlice

transformers = pytest.importorskip("transformers")

TINY_CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def _save_tiny(kind: str, folder: Path, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    model = model_cls(config_cls(**{**TINY_CONFIG, **overrides})).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def _ours_and_reference(kind: str, tmp_path: Path, **overrides: object) -> tuple[DecoderModel, KVCache, torch.Tensor]:
    """Our model of a saved tiny `kind` (TINY_CONFIG with `overrides`), an empty 2-slot KV cache, and
    transformers' logits for PROMPT + [11, 12]."""
    reference = _save_tiny(kind, tmp_path, **overrides)
    arch, state = load_weights(resolve_model(str(tmp_path)))
    ours = DecoderModel(arch)
    ours.load_state(state)
    kv = KVCache(arch, slots=2, max_len=32, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        ref_logits = reference(torch.tensor([[*PROMPT, 11, 12]])).logits[0]
    return ours, kv, ref_logits


PROMPT = [5, 17, 42, 8, 90, 3]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_prefill_and_decode_match_transformers(kind: str, tmp_path: Path) -> None:
    ours, kv, ref_logits = _ours_and_reference(kind, tmp_path)
    assert ours.arch.arch == kind and ours.arch.qkv_bias == (kind == "qwen2")
    prompt = PROMPT
    # Prefill the prompt in slot 1, then decode two tokens one by one.
    logits = ours(torch.tensor(prompt), torch.arange(len(prompt)), [SeqSlice(1, 0, len(prompt), len(prompt))], kv, None)
    torch.testing.assert_close(logits[0], ref_logits[len(prompt) - 1], rtol=1e-4, atol=1e-4)
    for step, token in enumerate([11, 12]):
        pos = len(prompt) + step
        logits = ours(torch.tensor([token]), torch.tensor([pos]), [SeqSlice(1, 0, 1, pos + 1)], kv, None)
        torch.testing.assert_close(logits[0], ref_logits[pos], rtol=1e-4, atol=1e-4)


def test_two_sequences_in_one_step_do_not_mix(tmp_path: Path) -> None:
    _save_tiny("llama", tmp_path)
    arch, state = load_weights(resolve_model(str(tmp_path)))
    model = DecoderModel(arch)
    model.load_state(state)
    kv = KVCache(arch, slots=2, max_len=32, dtype=torch.float32, device=torch.device("cpu"))
    a, b = [1, 2, 3, 4], [9, 8, 7]
    alone_a = model(torch.tensor(a), torch.arange(4), [SeqSlice(0, 0, 4, 4)], kv, None)
    alone_b = model(torch.tensor(b), torch.arange(3), [SeqSlice(1, 0, 3, 3)], kv, None)
    both = model(
        torch.tensor(a + b), torch.tensor([0, 1, 2, 3, 0, 1, 2]), [SeqSlice(0, 0, 4, 4), SeqSlice(1, 4, 3, 3)], kv, None
    )
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), rtol=1e-5, atol=1e-5)


def test_unknown_model_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"expected a \.gguf file"):
        resolve_model(str(tmp_path / "missing"))


def test_batched_decode_step_matches_per_sequence_decode(tmp_path: Path) -> None:
    _save_tiny("qwen2", tmp_path)
    arch, state = load_weights(resolve_model(str(tmp_path)))
    model = DecoderModel(arch)
    model.load_state(state)
    prompts = {0: [1, 2, 3, 4, 5], 2: [9, 8, 7]}  # kv slot -> prompt (different lengths, slot 1 unused)

    def prefill(kv: KVCache) -> None:
        for slot, p in prompts.items():
            model(torch.tensor(p), torch.arange(len(p)), [SeqSlice(slot, 0, len(p), len(p))], kv, None)

    alone_kv = KVCache(arch, slots=3, max_len=32, dtype=torch.float32, device=torch.device("cpu"))
    prefill(alone_kv)
    alone = [
        model(torch.tensor([40 + slot]), torch.tensor([len(p)]), [SeqSlice(slot, 0, 1, len(p) + 1)], alone_kv, None)
        for slot, p in prompts.items()
    ]
    batched_kv = KVCache(arch, slots=3, max_len=32, dtype=torch.float32, device=torch.device("cpu"))
    prefill(batched_kv)
    seqs = [SeqSlice(slot, i, 1, len(p) + 1) for i, (slot, p) in enumerate(prompts.items())]
    both = model(torch.tensor([40, 42]), torch.tensor([5, 3]), seqs, batched_kv, None)
    torch.testing.assert_close(both, torch.cat(alone), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched_kv.k[1], alone_kv.k[1])  # the caches were written the same way


def test_padded_prefill_and_buffer_decode_match_transformers(tmp_path: Path) -> None:
    """The device-tensor-only paths the CUDA graphs capture (`prefill`, `decode`), run eagerly on the CPU:
    a prompt padded past its end, then decode steps padded with scratch-row sequences."""
    ours, kv, ref_logits = _ours_and_reference("llama", tmp_path)
    prompt = PROMPT
    padded = torch.tensor([*prompt, 0, 0, 0, 0])  # padded to 10 tokens
    view = PrefillView(slot=torch.tensor([1]), last=torch.tensor([len(prompt) - 1]))
    logits = ours.prefill(padded, torch.arange(10), view, kv, None)
    torch.testing.assert_close(logits[0], ref_logits[len(prompt) - 1], rtol=1e-4, atol=1e-4)
    for step, token in enumerate([11, 12]):
        pos = len(prompt) + step
        # Row 0 is the sequence; row 1 pads the batch, writing at position 0 of the scratch row.
        decode = DecodeView.of_buffers(torch.tensor([1, kv.scratch_slot]), torch.tensor([pos, 0]), max_len=16)
        logits = ours.decode(torch.tensor([token, 0]), decode, kv, None)
        torch.testing.assert_close(logits[0], ref_logits[pos], rtol=1e-4, atol=1e-4)


def test_rope_theta_of_a_transformers_5_config(tmp_path: Path) -> None:
    """transformers >= 5 saves the rotary base inside `rope_parameters`, not as `rope_theta`."""
    ours, kv, ref_logits = _ours_and_reference("llama", tmp_path, rope_theta=100000.0)
    assert "rope_theta" not in json.loads((tmp_path / "config.json").read_text())
    assert ours.arch.rope_theta == 100000.0
    n = len(PROMPT) + 2
    logits = ours(torch.tensor([*PROMPT, 11, 12]), torch.arange(n), [SeqSlice(0, 0, n, n)], kv, None)
    torch.testing.assert_close(logits[0], ref_logits[n - 1], rtol=1e-5, atol=1e-5)


def _old_style_config(folder: Path, rope_scaling: dict[str, object]) -> None:
    # config.json as transformers 4 wrote it (and most hub models still have it): top-level rope_theta and
    # rope_scaling, no rope_parameters.
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=10000.0, rope_scaling=rope_scaling)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_scaled_rope_is_refused(style: str, tmp_path: Path) -> None:
    """Our rotary tables are unscaled: loading such a model anyway would give wrong logits past position 0."""
    if style == "rope_parameters":
        _save_tiny("llama", tmp_path, rope_scaling={"rope_type": "linear", "factor": 2.0})
    else:
        _save_tiny("llama", tmp_path)
        _old_style_config(tmp_path, {"type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match=f"unsupported {style} type 'linear'"):
        load_weights(resolve_model(str(tmp_path)))


def test_unscaled_old_style_config_loads(tmp_path: Path) -> None:
    _save_tiny("llama", tmp_path)
    _old_style_config(tmp_path, {"rope_type": "default"})
    assert load_weights(resolve_model(str(tmp_path)))[0].rope_theta == 10000.0


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
def test_llama_biases_beyond_qkv_are_refused(bias: str, tmp_path: Path) -> None:
    """Llama's attention_bias adds an o_proj bias, mlp_bias gate/up/down ones: our layers have none, and
    dropping them silently changed every logit."""
    _save_tiny("llama", tmp_path, **{bias: True})
    with pytest.raises(ValueError, match=r"unexpected tensor layers\.0\.(self_attn\.o_proj|mlp\.\w+_proj)\.bias"):
        load_weights(resolve_model(str(tmp_path)))


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("mistral", dict(sliding_window=4)),
        ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
    ],
)
def test_sliding_window_caps_the_context(kind: str, overrides: dict[str, object], tmp_path: Path) -> None:
    """Our attention has no window, so the context stops at it: within it, transformers' windowed attention
    sees every key too (past it, our logits differed)."""
    ours, kv, ref_logits = _ours_and_reference(kind, tmp_path, **overrides)
    assert ours.arch.max_position == 4
    logits = ours(torch.tensor(PROMPT[:4]), torch.arange(4), [SeqSlice(0, 0, 4, 4)], kv, None)
    torch.testing.assert_close(logits[0], ref_logits[3], rtol=1e-4, atol=1e-4)


def test_qwen2_sliding_window_off_keeps_the_context(tmp_path: Path) -> None:
    _save_tiny("qwen2", tmp_path, use_sliding_window=False, sliding_window=4)
    assert load_weights(resolve_model(str(tmp_path)))[0].max_position == TINY_CONFIG["max_position_embeddings"]
