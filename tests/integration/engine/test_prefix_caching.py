"""Prefix caching on the real model: requests that share a system prompt, a chat's next turn and requests that
join beside one with the same start read those tokens' keys from the cache, and get the greedy tokens of an
engine that prefills everything; keys computed under an adapter serve only that adapter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from tests.integration.engine.conftest import Collector, run
from tests.support.model_files import demo_adapter_dir

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SYSTEM = (
    "You are the assistant of a harbour office. Answer questions about berths, tides, pilots, cargo "
    "and the opening hours of the office, briefly and politely."
)
QUESTIONS = ("When is high tide?", "Where do I moor?", "Who are the pilots?", "What cargo goes out today?")


def _prompt(engine: LLMEngine, question: str) -> list[int]:
    return engine.tokenizer.encode_chat([("system", SYSTEM), ("user", question)])


@pytest.fixture(scope="module")
def uncached(engine: LLMEngine) -> Iterator[LLMEngine]:
    """An engine like the shared one with prefix caching off: every prompt prefilled whole."""
    eng = LLMEngine(
        EngineConfig(
            max_num_seqs=4,
            max_model_len=256,
            max_num_batched_tokens=512,
            lora_slots=4,
            max_lora_rank=16,
            async_steps=engine.config.async_steps,
            prefix_caching="off",
        )
    )
    eng.load_adapter("pirate", str(demo_adapter_dir("pirate")), wait=True)
    eng.start()
    yield eng
    eng.stop()


def _tokens(
    engine: LLMEngine, name: str, prompt: list[int], adapter: str | None = None, params: SamplingParams = GREEDY
) -> list[int]:
    sink = run(engine, name, prompt, params, adapter)
    sink.wait()
    return sink.token_ids


def test_a_shared_system_prompt_is_prefilled_once_per_adapter(engine: LLMEngine, uncached: LLMEngine) -> None:
    engine.load_adapter("pirate", str(demo_adapter_dir("pirate")), wait=True)
    cache = engine.prefix_cache
    shared = len(engine.tokenizer.encode_chat([("system", SYSTEM)])) - 8  # the template's end of turn aside
    for adapter in (None, "pirate"):
        first = _prompt(engine, QUESTIONS[0])
        hits = cache.hit_tokens
        assert _tokens(engine, f"first-{adapter}", first, adapter) == _tokens(uncached, f"u0-{adapter}", first, adapter)
        # The other adapter's keys (or the base model's) are no use: nothing read from the cache.
        assert cache.hit_tokens == hits
        for i, question in enumerate(QUESTIONS[1:]):
            prompt = _prompt(engine, question)
            hits = cache.hit_tokens
            expected = _tokens(uncached, f"u{i}-{adapter}", prompt, adapter)
            assert _tokens(engine, f"next{i}-{adapter}", prompt, adapter) == expected, (adapter, question)
            assert cache.hit_tokens - hits >= shared


def test_the_next_turn_of_a_chat_reads_the_last_turn_and_its_reply_from_the_cache(
    engine: LLMEngine, uncached: LLMEngine
) -> None:
    turn = [("system", SYSTEM), ("user", "Name a ship.")]
    first = engine.tokenizer.encode_chat(turn)
    sink = run(engine, "turn-1", first, GREEDY)
    sink.wait()
    following = engine.tokenizer.encode_chat([*turn, ("assistant", sink.text), ("user", "And another one?")])
    hits = engine.prefix_cache.hit_tokens
    assert _tokens(engine, "turn-2", following) == _tokens(uncached, "u-turn-2", following)
    assert engine.prefix_cache.hit_tokens - hits >= len(first)


def test_requests_joining_one_with_the_same_start_copy_its_keys_and_match_a_full_prefill(
    engine: LLMEngine, uncached: LLMEngine
) -> None:
    prompts = [_prompt(engine, f"Question {i}: is the office open on day {i}?") for i in range(3)]
    expected = [_tokens(uncached, f"u-join-{i}", p) for i, p in enumerate(prompts)]
    long_running = SamplingParams(max_tokens=40, ignore_eos=True)
    leader = Collector()
    # A start no row holds yet: the followers' prefix can only come from the leader's row while it runs.
    lead_prompt = engine.tokenizer.encode_chat([("system", SYSTEM + " Today is a holiday."), ("user", "Hello.")])
    follow = [engine.tokenizer.encode_chat([("system", SYSTEM + " Today is a holiday."), ("user", p)]) for p in "AB"]
    engine.add_request("leader", lead_prompt, long_running, None, leader)
    while len(leader.outputs) < 2:
        leader.done.wait(0.005)
    hits = engine.prefix_cache.hit_tokens
    followers = [run(engine, f"follower-{i}", prompt, GREEDY) for i, prompt in enumerate(follow)]
    for follower in followers:
        follower.wait()
    assert not leader.done.is_set(), "the leader should still run while the followers join"
    assert engine.prefix_cache.hit_tokens - hits >= 2 * (len(lead_prompt) - 16)
    for i, prompt in enumerate(follow):
        assert followers[i].token_ids == _tokens(uncached, f"u-follow-{i}", prompt)
    leader.wait()
    assert leader.token_ids == _tokens(uncached, "u-leader", lead_prompt, params=long_running)
    assert [_tokens(engine, f"join-{i}", p) for i, p in enumerate(prompts)] == expected
