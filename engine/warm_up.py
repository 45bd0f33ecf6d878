"""A few requests through the step path at start-up, so that the first real ones pay no one-time costs.

Captured graphs load every kernel they hold when they are captured, but a step also runs kernels outside them:
joining the decode graph's logits with a prefill's, reading the inputs from a step in flight, sampling,
log-probabilities. CUDA loads a kernel's module when it is first launched (lazy loading, the default), and
in a fresh process the first warm joins under async steps made steps of 11-17 ms where later ones took
1-3 ms (`bench/RESULTS-gpu.md`, stop 24; a process started with `CUDA_MODULE_LOADING=EAGER` had none). The
warm-up runs those paths once, before the engine takes requests, and leaves no trace: no KV row held, no
prefix-cache entry, no adapter, the counters as they were.

A cold adapter's way in has one-time costs of its own: the first cold joins of a fresh process (one H100,
Llama-7B dims, stop 26) made others' p99 10.9x steady where a second engine in the same process measured
2.1x, with steps of 23-50 ms whose decode and sampling phases waited. So the warm-up also loads a zero
adapter (written to a temporary folder) through the engine's loader, fills a slot with it beside a step in
flight, decodes on it, and unloads it.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.adapters import CONFIG_FILE, WEIGHTS_FILE
from engine.config import LORA_MODULES, ModelArch
from engine.errors import EngineError
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.engine import LLMEngine

log = logging.getLogger("engine")

_PROMPT_TOKENS = 4
_MAX_TOKENS = 3
# Two requests decode; two join while a step is in flight, one greedy, one sampled with log-probabilities.
_RUNNING = SamplingParams(max_tokens=_MAX_TOKENS, ignore_eos=True)
_JOINING = (
    SamplingParams(max_tokens=_MAX_TOKENS, ignore_eos=True),
    SamplingParams(max_tokens=_MAX_TOKENS, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=20, seed=0, logprobs=2),
)
ADAPTER = "adaptergate-warm-up"  # the zero adapter's name while the warm-up holds it
_ADAPTER_RANK = 8


def warm_up(engine: LLMEngine) -> int:
    """Run the warm-up requests to their end on the calling thread (before the step loop starts); returns the
    steps it took (0 where the engine's context is too short for them)."""
    if engine.max_model_len <= _PROMPT_TOKENS + _MAX_TOKENS:
        return 0
    prompt = [i % engine.arch.vocab_size for i in range(1, _PROMPT_TOKENS + 1)]
    cache, pool = engine.prefix_cache, engine.pool
    caching, cache.enabled = cache.enabled, False  # its rows would keep the warm-up's tokens
    counts = (engine.steps, engine.tokens_generated, engine.forward.folded_rows, engine.forward.folded_prompts)
    loads = (pool.loads_started, pool.slot_hits, pool.slot_misses, pool.fills_ahead, pool.evictions)
    try:
        with tempfile.TemporaryDirectory(prefix="adaptergate-warm-up-") as folder:
            adapter = _load_zero_adapter(engine, Path(folder))
            try:
                for i in range(2):
                    _add(engine, f"warm-up-{i}", prompt, _RUNNING)
                for _ in range(2):  # admit and prefill, then a step whose tokens stay in flight under async steps
                    engine._drain_commands()
                    engine.step()
                for i, params in enumerate(_JOINING):
                    _add(engine, f"warm-up-join-{i}", prompt, params)
                if adapter:  # a cold join: its slot is filled beside the step in flight
                    _add(engine, "warm-up-adapter", prompt, _RUNNING, ADAPTER)
                engine.run_until_idle()
            finally:
                if adapter:
                    engine.unload_adapter(ADAPTER)
    finally:
        cache.enabled = caching
    steps = engine.steps - counts[0]
    engine.steps, engine.tokens_generated, engine.forward.folded_rows, engine.forward.folded_prompts = counts
    pool.loads_started, pool.slot_hits, pool.slot_misses, pool.fills_ahead, pool.evictions = loads
    return steps


def _load_zero_adapter(engine: LLMEngine, folder: Path) -> bool:
    """Write a zero adapter into `folder` and load it into host memory as `ADAPTER`: its check and load run on
    the engine's loader (threads or processes, into the shared arena where there is one). A failure is logged,
    never raised: the adapter path then pays its one-time costs at the first real cold join instead."""
    try:
        write_zero_adapter(folder, engine.arch, min(_ADAPTER_RANK, engine.config.max_lora_rank), engine.dtype)
        engine.load_adapter(ADAPTER, str(folder), wait=True)
    except (EngineError, OSError) as exc:
        log.warning("start-up warm-up: the adapter path was not warmed up (%s)", exc)
        engine.unload_adapter(ADAPTER)
        return False
    return True


def write_zero_adapter(folder: Path, arch: ModelArch, rank: int, dtype: torch.dtype) -> None:
    """A PEFT LoRA adapter of `rank` on every targetable projection of every layer, all weights zero (its delta
    is zero: a request on it gets the base model's tokens)."""
    from safetensors.torch import save_file

    shapes = arch.projection_shapes()
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        for module in LORA_MODULES:
            fan_in, fan_out = shapes[module]
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.zeros(rank, fan_in, dtype=dtype)
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(fan_out, rank, dtype=dtype)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(LORA_MODULES)}
    (folder / CONFIG_FILE).write_text(json.dumps(config))


def _add(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, adapter: str | None = None
) -> None:
    """Add a warm-up request, unless the engine's limits refuse it (a `max_waiting` below the warm-up's
    requests): a warm-up never keeps an engine from starting."""
    try:
        engine.add_request(request_id, prompt, params, adapter, _ignore)
    except EngineError as exc:
        if exc.code != "RESOURCE_EXHAUSTED":
            raise


def _ignore(_output: object) -> None:
    """The warm-up's outputs go nowhere."""
