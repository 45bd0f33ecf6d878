"""A few requests through the step path at start-up, so that the first real ones pay no one-time costs.

Captured graphs load every kernel they hold when they are captured, but a step also runs kernels outside them:
joining the decode graph's logits with a prefill's, reading the inputs from a step in flight, sampling,
log-probabilities. CUDA loads a kernel's module when it is first launched (lazy loading, the default), and
in a fresh process the first warm joins under async steps made steps of 11-17 ms where later ones took
1-3 ms (`bench/RESULTS-gpu.md`, stop 24; a process started with `CUDA_MODULE_LOADING=EAGER` had none). The
warm-up runs those paths once, before the engine takes requests, and leaves no trace: no KV row held, no
prefix-cache entry, the counters as they were.

A cold adapter's way in (its load, the slot fill beside a step in flight) is not warmed up: in fresh
processes the first cold joins made no slow step without it (slowest 1.5 ms; `bench/first_joins.py --joins
cold`, one H100, stop 26), and a zero adapter taken through it at start-up left the first engine's cold
joins at Llama-7B dims as slow as before (their stalls came from a full pinned arena instead:
`AdapterPool._make_arena_room`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import EngineError
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.engine import LLMEngine

_PROMPT_TOKENS = 4
_MAX_TOKENS = 3
# Two requests decode; two join while a step is in flight, one greedy, one sampled with log-probabilities.
_RUNNING = SamplingParams(max_tokens=_MAX_TOKENS, ignore_eos=True)
_JOINING = (
    SamplingParams(max_tokens=_MAX_TOKENS, ignore_eos=True),
    SamplingParams(max_tokens=_MAX_TOKENS, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=20, seed=0, logprobs=2),
)


def warm_up(engine: LLMEngine) -> int:
    """Run the warm-up requests to their end on the calling thread (before the step loop starts); returns the
    steps it took (0 where the engine's context is too short for them)."""
    if engine.max_model_len <= _PROMPT_TOKENS + _MAX_TOKENS:
        return 0
    prompt = [i % engine.arch.vocab_size for i in range(1, _PROMPT_TOKENS + 1)]
    cache = engine.prefix_cache
    caching, cache.enabled = cache.enabled, False  # its rows would keep the warm-up's tokens
    forward = engine.forward
    counts = (engine.steps, engine.tokens_generated, forward.folded_rows, forward.folded_prompts, forward.eager_runs)
    grouped = forward.grouped_prompts
    # The two starting prompts replay prefill graphs, as a lone request's prompt does: grouped, they would run
    # as decode rows, and the first real prefill would pay the one-time costs this is here to take.
    grouping, forward.group_prompts = forward.group_prompts, False
    try:
        for i in range(2):
            _add(engine, f"warm-up-{i}", prompt, _RUNNING)
        for _ in range(2):  # admit and prefill, then a step whose tokens stay in flight under async steps
            engine._drain_commands()
            engine.step()
        for i, params in enumerate(_JOINING):
            _add(engine, f"warm-up-join-{i}", prompt, params)
        engine.run_until_idle()
    finally:
        cache.enabled = caching
        forward.group_prompts = grouping
    steps = engine.steps - counts[0]
    engine.steps, engine.tokens_generated, forward.folded_rows, forward.folded_prompts, forward.eager_runs = counts
    forward.grouped_prompts = grouped
    return steps


def _add(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    """Add a warm-up request, unless the engine's limits refuse it (a `max_waiting` below the warm-up's
    requests): a warm-up never keeps an engine from starting."""
    try:
        engine.add_request(request_id, prompt, params, None, _ignore)
    except EngineError as exc:
        if exc.code != "RESOURCE_EXHAUSTED":
            raise


def _ignore(_output: object) -> None:
    """The warm-up's outputs go nowhere."""
