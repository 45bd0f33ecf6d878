"""Engine behaviour on the real model: continuous batching, stops, limits, abort, cold adapter loads."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest

import engine.adapter_loader as loader_module
from engine.engine import LLMEngine
from engine.errors import EngineError
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from tests.integration.engine.conftest import Collector, run
from tests.support.model_files import demo_adapter_dir
from tests.unit.engine.tiny import write_adapter

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def chat(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([("user", text)])


def test_requests_join_a_running_batch_and_match_their_solo_output(engine: LLMEngine) -> None:
    long_prompt, short_prompt = chat(engine, "Describe the sea."), chat(engine, "Name a fruit.")
    solo_long = run(engine, "solo-long", long_prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    solo_long.wait()
    solo_short = run(engine, "solo-short", short_prompt, GREEDY)
    solo_short.wait()

    steps_before = engine.steps
    a = run(engine, "a", long_prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    while len(a.outputs) < 5:
        time.sleep(0.005)
    b = run(engine, "b", short_prompt, GREEDY)  # joins while `a` is decoding
    b.wait()
    assert not a.done.is_set(), "b should finish while a is still running"
    a.wait()
    assert a.token_ids == solo_long.token_ids
    assert b.token_ids == solo_short.token_ids
    # Shared steps: far fewer than running the two requests back to back.
    assert engine.steps - steps_before < 40 + 24


def test_max_tokens_gives_length_and_usage(engine: LLMEngine) -> None:
    prompt = chat(engine, "Count to twenty.")
    last = run(engine, "len", prompt, SamplingParams(max_tokens=5, ignore_eos=True)).wait()
    assert last.finish_reason == "length"
    assert (last.prompt_tokens, last.completion_tokens) == (len(prompt), 5)


def test_stop_string_ends_and_is_not_returned(engine: LLMEngine) -> None:
    prompt = chat(engine, "What is the capital of France?")
    full = run(engine, "full", prompt, SamplingParams(max_tokens=20))
    full.wait()
    assert "Paris" in full.text
    stopped = run(engine, "stop", prompt, SamplingParams(max_tokens=20, stop=("Paris",)))
    last = stopped.wait()
    assert last.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index("Paris")]


def test_abort_ends_the_request_promptly(engine: LLMEngine) -> None:
    sink = run(engine, "abort-me", chat(engine, "Write a long story."), SamplingParams(max_tokens=200, ignore_eos=True))
    while len(sink.outputs) < 2:
        time.sleep(0.005)
    assert engine.abort("abort-me")
    assert sink.wait(timeout=5).finish_reason == "abort"
    assert len(sink.token_ids) < 200
    assert not engine.abort("abort-me")


def test_the_engine_loop_outlives_a_failure_outside_a_step(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the step was guarded: an exception in the loop around it ended the engine thread, and every request
    # from then on waited forever.
    failed = threading.Event()
    real_reap = engine._reap

    def reap_that_fails_once() -> None:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("injected")
        real_reap()

    monkeypatch.setattr(engine, "_reap", reap_that_fails_once)
    first = run(engine, "loop-1", chat(engine, "Hi"), SamplingParams(max_tokens=4, ignore_eos=True))
    assert first.wait(timeout=20).finish_reason in ("error", "length")  # failed if it was waiting then
    assert failed.is_set()
    second = run(engine, "loop-2", chat(engine, "Hi"), SamplingParams(max_tokens=4, ignore_eos=True))
    assert second.wait(timeout=20).finish_reason == "length"


def test_waiting_requests_are_counted_while_they_join_the_queue(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `add_request` bounds the waiting requests by the queue's length plus those on their way to it, under the
    # engine's lock; the hand-over from one count to the other once ran outside it (and a list being sorted
    # reads as empty), so more than `max_waiting` could be let in.
    held: list[bool] = []
    real_add = engine.scheduler.add

    def add(seq: object) -> None:
        held.append(engine._lock.locked())
        real_add(seq)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.scheduler, "add", add)
    assert run(engine, "count-1", chat(engine, "Hi"), SamplingParams(max_tokens=2)).wait(timeout=20)
    assert held == [True]


def test_bad_requests_are_refused_with_reasons(engine: LLMEngine) -> None:
    with pytest.raises(EngineError) as unknown:
        run(engine, "u", [1, 2, 3], GREEDY, adapter="no-such-adapter")
    assert unknown.value.code == "NOT_FOUND"
    with pytest.raises(EngineError) as long:
        run(engine, "l", [1] * 300, GREEDY)
    assert long.value.code == "INVALID_ARGUMENT" and "context" in long.value.message
    with pytest.raises(EngineError) as bad_ids:
        run(engine, "i", [1, 10**9], GREEDY)
    assert bad_ids.value.code == "INVALID_ARGUMENT"


def test_an_adapter_check_that_times_out_is_deadline_exceeded(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A check queued behind many loads can time out: that is no reason to call the adapter invalid."""

    def too_slow(*_: object) -> None:
        raise TimeoutError

    monkeypatch.setattr(engine.pool, "register", too_slow)
    with pytest.raises(EngineError) as late:
        engine.load_adapter("late", str(tmp_path))
    assert late.value.code == "DEADLINE_EXCEEDED" and "'late'" in late.value.message


def test_more_requests_than_kv_slots_wait_then_finish(engine: LLMEngine) -> None:
    prompt = chat(engine, "Say hello.")
    sinks = [run(engine, f"kv-{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(8)]
    assert all(s.wait().finish_reason == "length" for s in sinks)
    # Beyond max_waiting the engine refuses instead of queueing forever.
    many = [SamplingParams(max_tokens=30, ignore_eos=True)] * 16
    accepted, refused = [], 0
    for i, p in enumerate(many):
        try:
            accepted.append(run(engine, f"flood-{i}", prompt, p))
        except EngineError as exc:
            assert exc.code == "RESOURCE_EXHAUSTED"
            refused += 1
    assert refused > 0
    assert all(s.wait().finish_reason == "length" for s in accepted)


def test_cold_adapter_never_stalls_other_requests(
    engine: LLMEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, loading = threading.Event(), threading.Event()
    real_load = loader_module.load_adapter

    def slow_load(*args, **kwargs):  # type: ignore[no-untyped-def]
        loading.set()
        release.wait(60)  # a slow disk: the load finishes only when the test says so
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader_module, "load_adapter", slow_load)
    engine.load_adapter("cold", str(write_adapter(tmp_path / "cold", arch=engine.arch, rank=8, seed=5)))
    base = run(engine, "warm-base", chat(engine, "Tell me about cats."), SamplingParams(max_tokens=60, ignore_eos=True))
    try:
        while len(base.outputs) < 2:
            time.sleep(0.005)
        cold = run(engine, "cold-req", chat(engine, "Tell me about dogs."), GREEDY, adapter="cold")  # admitted at once
        assert loading.wait(10)
        # While the load hangs, the base request keeps decoding (a stalled one would make no progress until the
        # test releases the load below): wait for 4 more of its tokens, however slowly this machine steps.
        produced_before = len(base.outputs)
        give_up = time.monotonic() + 30
        while len(base.outputs) <= produced_before + 3:
            assert time.monotonic() < give_up, "base request stalled while the adapter was loading"
            time.sleep(0.005)
        assert not cold.outputs
    finally:
        release.set()
    assert cold.wait().finish_reason == "length"
    assert len(cold.token_ids) == GREEDY.max_tokens
    base.wait()
    engine.unload_adapter("cold")


def test_seeded_sampling_is_reproducible_in_any_batch(engine: LLMEngine) -> None:
    prompt = chat(engine, "Invent a name for a cat.")
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run(engine, "seed-alone", prompt, params)
    alone.wait()
    neighbour = run(engine, "seed-neighbour", chat(engine, "Hi"), SamplingParams(max_tokens=30, temperature=1.0))
    together = run(engine, "seed-together", prompt, params)
    together.wait()
    neighbour.wait()
    assert together.token_ids == alone.token_ids


def test_the_context_length_ends_a_request_beside_others(engine: LLMEngine) -> None:
    """A request that fills its context ends there, while another decodes on; an engine stepping ahead must
    not launch a row past the context for it (its KV position would not exist)."""
    other = run(engine, "beside", chat(engine, "Describe the sea."), SamplingParams(max_tokens=30, ignore_eos=True))
    full = run(engine, "fills", [42] * 250, SamplingParams(max_tokens=20, ignore_eos=True)).wait()
    assert (full.finish_reason, full.completion_tokens) == ("length", 6)  # 250 + 6 = max_model_len 256
    assert other.wait().completion_tokens == 30


def test_a_stepping_engine_matches_a_synchronous_one() -> None:
    """Outputs of every kind of ending (end token, stop string, length), stepped by hand on two engines."""
    from engine.config import EngineConfig

    results, ahead = [], []
    for mode in ("off", "on"):
        eng = LLMEngine(EngineConfig(max_num_seqs=4, max_model_len=128, async_steps=mode))
        prompts = [chat(eng, text) for text in ("Hi!", "What is the capital of France?", "Count to ten.")]
        params = [
            SamplingParams(max_tokens=60),
            SamplingParams(max_tokens=30, stop=("Paris",)),
            SamplingParams(max_tokens=12, ignore_eos=True),
        ]
        sinks = [Collector() for _ in prompts]
        launched: list[bool] = []  # per output: was the next step already launched when it was handed out?

        def sink(out: RequestOutput, to: Collector, eng: LLMEngine = eng, launched: list[bool] = launched) -> None:
            launched.append(eng._inflight is not None)
            to(out)

        for i, (prompt, p, to) in enumerate(zip(prompts, params, sinks, strict=True)):
            eng.add_request(f"r{i}", prompt, p, None, functools.partial(sink, to=to))
        eng.run_until_idle()
        assert all(s.done.is_set() for s in sinks)
        results.append([(s.token_ids, s.text, s.outputs[-1].finish_reason) for s in sinks])
        ahead.append(sum(launched) / len(launched))
        eng.stop()
    assert [reason for *_, reason in results[1]] == ["stop", "stop", "length"]
    assert results[0] == results[1]
    assert ahead[0] == 0 and ahead[1] > 0.8, ahead  # outputs came out while the next step ran


def test_an_adapter_is_filled_ahead_while_the_step_before_its_request_runs(tmp_path: Path) -> None:
    """A request arriving while a step runs has its adapter copied into a slot during that step, so the
    step that admits it copies nothing; its tokens are those of an engine that fills slots on admission."""
    from engine.config import EngineConfig

    outputs, fills = [], []
    for ahead in (2, 0):
        eng = LLMEngine(EngineConfig(max_num_seqs=4, max_model_len=128, lora_slots=2, adapter_fills_ahead=ahead))
        eng.load_adapter("late", str(write_adapter(tmp_path / "late", arch=eng.arch, rank=8, seed=3)), wait=True)
        version = eng.pool.lookup("late")
        assert version is not None
        base, late = Collector(), Collector()
        eng.add_request("base", chat(eng, "Count to ten."), SamplingParams(max_tokens=8, ignore_eos=True), None, base)
        eng._drain_commands()
        eng.step()  # the base request runs
        eng.add_request(
            "late", chat(eng, "Name a colour."), SamplingParams(max_tokens=6, ignore_eos=True), "late", late
        )
        eng.step()  # the late request arrives while this step runs
        assert not late.outputs
        fills.append((version.slot is not None, eng.pool.fills_ahead))
        eng.run_until_idle()
        assert late.done.is_set() and base.done.is_set()
        assert eng.pool.slot_misses == 1
        outputs.append((base.token_ids, late.token_ids))
        eng.stop()
    assert fills == [(True, 1), (False, 0)]
    assert outputs[0] == outputs[1]


def test_a_request_waiting_through_a_hot_swap_starts_on_the_new_version(tmp_path: Path) -> None:
    """The old version, idle, is dropped by the swap: the waiting request used to reload it at every step, each
    load dropped again as it ended, and never started. It has not started, so it gets the new version; a request
    whose adapter is unloaded while it waits ends with an error."""
    from engine.config import EngineConfig

    eng = LLMEngine(EngineConfig(max_num_seqs=1, max_model_len=128, lora_slots=2))
    try:
        v1 = write_adapter(tmp_path / "v1", arch=eng.arch, rank=8, seed=1)
        v2 = write_adapter(tmp_path / "v2", arch=eng.arch, rank=8, seed=2)
        eng.load_adapter("swap", str(v1), wait=True)
        eng.load_adapter("gone", str(v1), wait=True)
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        base = run(eng, "base", chat(eng, "Count to ten."), params)
        eng._drain_commands()
        eng.step()  # the base request holds the only KV slot: the next ones wait
        waiting = run(eng, "waits", chat(eng, "Name a colour."), params, adapter="swap")
        doomed = run(eng, "doomed", chat(eng, "Name a colour."), params, adapter="gone")
        eng.step()
        eng.load_adapter("swap", str(v2), wait=True)  # v1 is retired and, idle, dropped
        eng.unload_adapter("gone")
        eng.run_until_idle()
        assert base.done.is_set() and waiting.done.is_set() and doomed.done.is_set()
        assert doomed.outputs[-1].finish_reason == "error" and "unloaded" in (doomed.outputs[-1].error or "")
        alone = run(eng, "alone", chat(eng, "Name a colour."), params, adapter="swap")
        eng.run_until_idle()
        assert waiting.outputs[-1].finish_reason == "length" and waiting.token_ids == alone.token_ids
        assert eng.pool.cache_stats().loads == 3  # v1 twice (two names) and v2: no reload loop
    finally:
        eng.stop()


def test_a_hot_swap_of_an_adapter_in_use_fills_the_new_version_into_a_slot_ahead(tmp_path: Path) -> None:
    """The step after a swap of an adapter that holds a slot copies the new version into a slot before any
    request asks for it, so the first request on it waits for no copy; it then decodes as the same weights
    loaded afresh do."""
    from engine.config import EngineConfig

    eng = LLMEngine(EngineConfig(max_num_seqs=2, max_model_len=128, lora_slots=3))
    try:
        v1 = write_adapter(tmp_path / "v1", arch=eng.arch, rank=8, seed=1)
        v2 = write_adapter(tmp_path / "v2", arch=eng.arch, rank=8, seed=2)
        eng.load_adapter("swap", str(v1), wait=True)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        old = run(eng, "old", chat(eng, "Count to ten."), params, adapter="swap")
        eng._drain_commands()
        eng.step()  # v1 in a slot, decoding
        new = eng.load_adapter("swap", str(v2), wait=True)
        assert new.slot is None
        eng.step()
        assert new.slot is not None and eng.pool.cache_stats().fills_ahead == 1
        first = run(eng, "first", chat(eng, "Name a colour."), params, adapter="swap")
        eng.run_until_idle()
        eng.load_adapter("fresh", str(v2), wait=True)
        fresh = run(eng, "fresh", chat(eng, "Name a colour."), params, adapter="fresh")
        eng.run_until_idle()
        assert old.outputs[-1].finish_reason == first.outputs[-1].finish_reason == "length"
        assert first.token_ids == fresh.token_ids
    finally:
        eng.stop()


@pytest.mark.parametrize(("max_tokens", "timeout_s", "reason"), [(12, 60.0, "length"), (2000, 0.3, "error")])
def test_a_draining_engine_finishes_what_it_holds_and_refuses_the_rest(
    max_tokens: int, timeout_s: float, reason: str
) -> None:
    """SIGTERM drains (`request_drain`): new requests are refused with UNAVAILABLE (a gateway sends them to
    another engine), those in flight finish, or end with an error once the drain's deadline passes, and the
    step loop returns. It once returned at once, and the streams in flight were cut."""
    from engine.config import EngineConfig

    eng = LLMEngine(EngineConfig(max_num_seqs=2, max_model_len=2048))
    eng.start()
    try:
        running = run(eng, "drain-1", chat(eng, "Count to a thousand."), SamplingParams(max_tokens, ignore_eos=True))
        while not running.outputs:
            time.sleep(0.005)
        eng.request_drain(timeout_s)
        with pytest.raises(EngineError) as refused:
            run(eng, "drain-2", chat(eng, "Hi"), SamplingParams(max_tokens=2))
        assert refused.value.code == "UNAVAILABLE"
        last = running.wait(timeout=60)
        assert last.finish_reason == reason
        if reason == "length":
            assert len(running.token_ids) == max_tokens
        eng._thread.join(timeout=10)
        assert not eng._thread.is_alive()
    finally:
        eng.stop()


def test_a_long_prompt_prefilled_in_chunks_matches_a_whole_prefill_and_others_decode_meanwhile(
    engine: LLMEngine,
) -> None:
    """A prompt longer than `max_num_batched_tokens` is prefilled over several steps (a whole-prompt budget
    had been required): the same greedy tokens as the shared engine's whole prefill, on the base model and on
    an adapter, while a running request keeps getting a token at every one of those steps."""
    from engine.config import EngineConfig

    text = "Summarise this: " + " ".join(f"item {i} is {'red' if i % 2 else 'blue'}." for i in range(30))
    long_prompt, short_prompt = chat(engine, text), engine.tokenizer.encode("The sea is")
    budget = 32
    chunks = -(-len(long_prompt) // budget)
    assert chunks >= 4
    folder = str(demo_adapter_dir("pirate"))
    engine.load_adapter("pirate", folder, wait=True)
    whole = {a: run(engine, f"whole-{a}", long_prompt, GREEDY, a) for a in (None, "pirate")}
    chunked = LLMEngine(
        EngineConfig(
            max_num_seqs=4,
            max_model_len=256,
            max_num_batched_tokens=budget,
            lora_slots=2,
            max_lora_rank=16,
            async_steps=engine.config.async_steps,
        )
    )
    try:
        chunked.load_adapter("pirate", folder, wait=True)
        for adapter in (None, "pirate"):
            events: list[str] = []

            def sink(out: RequestOutput, to: Collector, name: str, events: list[str] = events) -> None:
                events.append(name)
                to(out)

            beside, long = Collector(), Collector()
            chunked.add_request("beside", short_prompt, GREEDY, None, functools.partial(sink, to=beside, name="b"))
            chunked.add_request("long", long_prompt, GREEDY, adapter, functools.partial(sink, to=long, name="l"))
            chunked.run_until_idle()
            whole[adapter].wait()
            assert long.token_ids == whole[adapter].token_ids, adapter
            # The first chunk shares its step with the short prompt's prefill; every later one with a decode.
            assert events.index("l") >= chunks - 1, events
    finally:
        chunked.stop()
