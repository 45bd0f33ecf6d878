"""The independent reference our engine is tested against: transformers + peft on the same GGUF, float32.

Greedy outputs follow the engine's conventions: only the new tokens are returned, and the EOS token that
ends a sequence is not part of them (the engine reports it as finish reason "stop", not as a token).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from peft import LoraConfig, PeftModel, PeftModelForCausalLM, TaskType
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from tests.support.model_files import DEMO_ADAPTERS, demo_adapter_dir, smollm2_gguf_path

# peft's name for "no adapter" in a mixed batch (`generate(..., adapter_names=[...])`).
BASE_ADAPTER = "__base__"


@functools.cache
def load_reference_model() -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct dequantized from its GGUF, float32, eval mode; loaded once per process.

    Callers must not modify the model: it is shared (peft models are built on deep copies of it).
    """
    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM)
    return model.eval(), tokenizer


def load_reference_peft(adapters: Mapping[str, Path]) -> PeftModelForCausalLM:
    """One PeftModel holding every adapter of `adapters` (name -> PEFT folder), float32, eval mode.

    Cached per distinct mapping; the result is shared, so select adapters per call with `adapter_names`
    rather than with `set_adapter`.
    """
    if not adapters:
        raise ValueError("load_reference_peft needs at least one adapter")
    if BASE_ADAPTER in adapters:
        raise ValueError(f"{BASE_ADAPTER!r} is reserved for base-only rows")
    return _load_peft(tuple(sorted((name, str(Path(path).resolve())) for name, path in adapters.items())))


@functools.cache
def _load_peft(adapters: tuple[tuple[str, str], ...]) -> PeftModelForCausalLM:
    # A deep copy: peft injects LoRA layers into the model it wraps, and the base model is shared.
    base = copy.deepcopy(load_reference_model()[0])
    model: PeftModel | None = None
    for name, path in adapters:
        config = LoraConfig.from_pretrained(path)
        # Only PeftModelForCausalLM (chosen by task type) accepts per-row `adapter_names` in generate().
        config.task_type = TaskType.CAUSAL_LM
        if model is None:
            model = PeftModel.from_pretrained(base, path, adapter_name=name, config=config)
        else:
            model.load_adapter(path, adapter_name=name, peft_config=config)
    assert isinstance(model, PeftModelForCausalLM)
    return model.eval()


def chat_prompt_ids(messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, ending with the assistant header."""
    _, tokenizer = load_reference_model()
    ids = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(i) for i in cast("list[int]", ids)]


@torch.no_grad()
def greedy_generate(
    prompts_token_ids: Sequence[Sequence[int]],
    adapter_names: Sequence[str | None],
    max_new_tokens: int,
    *,
    model: LlamaForCausalLM | PeftModelForCausalLM | None = None,
) -> list[list[int]]:
    """Greedy continuation of each prompt, one batch, row i with adapter `adapter_names[i]` (None = base).

    `model` defaults to the base model, or to one PeftModel holding every demo adapter
    (`tests.support.model_files.DEMO_ADAPTERS`) when a row names one; pass a `load_reference_peft` model
    for other adapters.
    Rows are left-padded with an attention mask, so each row sees only its own tokens. Returns, per row,
    the new tokens before the first EOS (at most `max_new_tokens`, counting that EOS).
    """
    if len(prompts_token_ids) != len(adapter_names):
        raise ValueError("one adapter name (or None) per prompt")
    if not prompts_token_ids:
        return []
    if any(len(p) == 0 for p in prompts_token_ids):
        raise ValueError("empty prompt")
    if model is None:
        model = _default_model(adapter_names)
    _, tokenizer = load_reference_model()
    eos = int(tokenizer.eos_token_id)
    pad = eos if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)

    width = max(len(p) for p in prompts_token_ids)
    input_ids = torch.tensor([[pad] * (width - len(p)) + [int(t) for t in p] for p in prompts_token_ids])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_token_ids])
    options: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    if isinstance(model, PeftModel):
        options["adapter_names"] = [name or BASE_ADAPTER for name in adapter_names]
    elif any(name not in (None, BASE_ADAPTER) for name in adapter_names):
        raise ValueError("adapter rows need a PeftModel (see load_reference_peft)")
    # transformers types generate's `self` as a protocol that its own model classes do not satisfy.
    out = model.generate(**options)  # type: ignore[misc]
    assert isinstance(out, torch.Tensor)
    results = []
    for row in out[:, width:].tolist():
        # Rows that finished early are filled with padding after their EOS: cut at the first EOS.
        results.append(row[: row.index(eos)] if eos in row else row)
    return results


def _default_model(adapter_names: Sequence[str | None]) -> LlamaForCausalLM | PeftModelForCausalLM:
    if all(name in (None, BASE_ADAPTER) for name in adapter_names):
        return load_reference_model()[0]
    # Always all of them: one shared model however the demo adapters are mixed across calls.
    return load_reference_peft({name: demo_adapter_dir(name) for name in DEMO_ADAPTERS})
