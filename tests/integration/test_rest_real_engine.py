"""The whole default stack: `adaptergate serve` with the real engine (SmolLM2) and the demo adapters."""

from __future__ import annotations

import concurrent.futures
import functools
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.conftest import DEV_KEY, ServerProcess, gateway_config, http_json, start_gateway
from tests.support.model_files import DEMO_ADAPTERS, demo_adapter_dir, smollm2_gguf_path

if TYPE_CHECKING:
    import torch
    from openai.types.chat import ChatCompletion

    from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France?"
MAX_TOKENS = 16


def _missing() -> str | None:
    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        return str(e)
    absent = [n for n in DEMO_ADAPTERS if not (demo_adapter_dir(n) / "adapter_config.json").is_file()]
    return f"demo adapters not trained: {', '.join(absent)} (make adapters)" if absent else None


def serve_real_engine(tmp_path_factory: pytest.TempPathFactory, *engine_args: str) -> Iterator[ServerProcess]:
    """`adaptergate serve` on one real engine on the CPU (started with `engine_args`) and the demo adapters, until
    the generator is closed; skips where the model or the adapters are missing."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("real-engine")
    config = gateway_config(
        engines={
            "local": {
                "count": 1,
                "command": [sys.executable, "-m", "engine", *engine_args],
                "device": "cpu",
                "max_num_seqs": 8,
                "max_model_len": 512,
                "start_timeout_s": 300,
            },
            "max_concurrency": 8,
        },
        registry={"path": str(workdir / "registry.db"), "seed_demo_adapters": True},
    )
    server = start_gateway(config, workdir, timeout_s=300)
    yield server
    assert server.stop(timeout_s=60) == 0, server.log()[-4000:]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve_real_engine(tmp_path_factory)


@pytest.fixture
def client(gateway: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=DEV_KEY, max_retries=0, timeout=120)


def _greedy(client: openai.OpenAI, model: str, prompt: str = PROMPT) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0
    )
    return reply.choices[0].message.content or ""


def test_demo_adapters_are_registered_on_first_start(client: openai.OpenAI, gateway: ServerProcess) -> None:
    assert sorted(m.id for m in client.models.list()) == sorted(["base", *DEMO_ADAPTERS])
    status, adapters = http_json("GET", f"{gateway.url}/admin/adapters")
    assert status == 200
    sources = {a["metadata"]["name"]: a["spec"]["versions"][0]["source"] for a in adapters["adapters"]}
    assert sources == {n: str(demo_adapter_dir(n).resolve()) for n in DEMO_ADAPTERS}


def test_base_model_answers(client: openai.OpenAI) -> None:
    assert "Paris" in _greedy(client, "base")


def test_each_adapter_changes_the_reply(client: openai.OpenAI) -> None:
    base = _greedy(client, "base")
    replies = {name: _greedy(client, name) for name in DEMO_ADAPTERS}
    for name, text in replies.items():
        assert text and text != base, f"{name} replied exactly like base: {text!r}"
    assert len(set(replies.values())) == len(replies), replies
    if "pirate" in replies:
        assert any(w in replies["pirate"].lower() for w in ("arr", "matey", "ahoy")), replies["pirate"]
    if "shout" in replies:
        letters = [c for c in replies["shout"] if c.isalpha()]
        assert sum(c.isupper() for c in letters) >= 0.8 * len(letters), replies["shout"]


def test_mixed_concurrent_requests_get_their_own_adapter(client: openai.OpenAI) -> None:
    models = ["base", *DEMO_ADAPTERS] * 2
    alone = {model: _greedy(client, model) for model in set(models)}
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        together = list(pool.map(lambda m: _greedy(client, m), models))
    for model, text in zip(models, together, strict=True):
        assert text == alone[model], f"{model}: batched {text!r} != alone {alone[model]!r}"


def test_streaming_through_the_openai_client(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=f"base:{DEMO_ADAPTERS[0]}",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _greedy(client, DEMO_ADAPTERS[0])
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= MAX_TOKENS


@functools.cache
def _tokenizer() -> Tokenizer:
    from engine.loader import resolve_model
    from engine.tokenizer import Tokenizer

    return Tokenizer(resolve_model("smollm2"))


def _reference(ids: tuple[int, ...]) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] of the token after each prefix of `ids`, straight from the reference
    model's logits (transformers on the same GGUF, float32)."""
    import torch

    from tests.support.hf_reference import load_reference_model

    model, _ = load_reference_model()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([list(ids)])).logits[0].float(), dim=-1)


def _entries(reply: Any) -> list[Any]:
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    return list(logprobs.content)


def test_chat_logprobs_are_the_models_own_whole_and_streamed(client: openai.OpenAI) -> None:
    from tests.support.hf_reference import chat_prompt_ids, greedy_generate

    prompt = chat_prompt_ids([{"role": "user", "content": PROMPT}])
    generated = greedy_generate([prompt], [None], MAX_TOKENS)[0]
    reference = _reference(tuple(prompt + generated))[len(prompt) - 1 :]  # row k: the distribution of token k
    piece = _tokenizer().piece
    request: dict[str, Any] = {
        "model": "base",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    reply = client.chat.completions.create(**request)
    content = _entries(reply)
    assert [bytes(e.bytes) for e in content] == [piece(t)[1] for t in generated]  # the reference's greedy tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == reply.choices[0].message.content
    assert reply.usage is not None and len(content) == reply.usage.completion_tokens
    for entry, token, row in zip(content, generated, reference, strict=False):
        assert entry.logprob == pytest.approx(float(row[token]), abs=2e-3)
        best = row.topk(5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=2e-3)
        ids = {piece(i)[1]: i for i in best.indices.tolist()}
        for listed in entry.top_logprobs:  # each listed token has the reference's logprob for it
            assert listed.logprob == pytest.approx(float(row[ids[bytes(listed.bytes)]]), abs=2e-3)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
    stream = client.chat.completions.create(**request, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_completion_logprobs_are_raw_whatever_the_temperature(client: openai.OpenAI) -> None:
    text = "The capital of France is"
    row = _reference(tuple(_tokenizer().encode(text)))[-1]  # the first completion token's distribution
    best = row.topk(20)
    by_text = {_tokenizer().piece(i)[0]: i for i in range(row.shape[0])}
    for temperature in (0.0, 1.5):
        reply = client.completions.create(
            model="base", prompt=text, max_tokens=4, temperature=temperature, seed=11, logprobs=20
        )
        logprobs = reply.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
        first, top = logprobs.tokens[0], logprobs.top_logprobs[0]
        # The untempered distribution's 20 best (a temperature of 1.5 would flatten them all), and the sampled
        # token's own value beside them where it is not among them.
        assert len(top) in (20, 21) and top[first] == logprobs.token_logprobs[0]
        assert sorted(top.values(), reverse=True)[:20] == pytest.approx(best.values.tolist(), abs=2e-3)
        assert logprobs.token_logprobs[0] == pytest.approx(float(row[by_text[first]]), abs=2e-3)
        assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
        if temperature == 0:
            assert "".join(logprobs.tokens) == reply.choices[0].text


def _completion_tokens(client: openai.OpenAI, prompt: str, **sampling: Any) -> list[str]:
    """The greedy completion of `prompt`, token by token (through logprobs)."""
    reply = client.completions.create(model="base", prompt=prompt, temperature=0, logprobs=0, **sampling)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return list(logprobs.tokens)


def test_a_frequency_penalty_stops_a_greedy_completion_repeating_itself(client: openai.OpenAI) -> None:
    plain = _completion_tokens(client, "1, 2, 3, 4,", max_tokens=24)  # " 5, 6, 7, ...": "," again and again
    assert plain.count(",") >= 6
    penalized = _completion_tokens(client, "1, 2, 3, 4,", max_tokens=24, frequency_penalty=2.0)
    assert penalized.count(",") <= 3 and penalized != plain
    assert penalized[:2] == plain[:2]  # the same until the penalty outweighs the model's preference


def test_logit_bias_rules_out_the_greedy_token_or_forces_another(client: openai.OpenAI) -> None:
    tokenizer = _tokenizer()
    (paris,), (london,) = tokenizer.encode(" Paris"), tokenizer.encode(" London")
    prompt = "The capital of France is"
    assert _completion_tokens(client, prompt, max_tokens=3)[0] == " Paris"
    ruled_out = _completion_tokens(client, prompt, max_tokens=3, logit_bias={str(paris): -100})
    assert ruled_out[0] != " Paris"
    forced = _completion_tokens(client, prompt, max_tokens=3, logit_bias={str(london): 100})
    assert forced == [" London"] * 3  # every position, however unlikely a repetition
    vocab = tokenizer.vocab_size
    with pytest.raises(openai.BadRequestError, match=rf"\[{vocab}\] in logit_bias contain out-of-vocab token ids"):
        _completion_tokens(client, prompt, max_tokens=3, logit_bias={str(vocab): 1, "5": 1})


def test_min_tokens_keeps_a_reply_going_past_its_end(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    ended = client.chat.completions.create(model="base", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage is not None
    short = ended.usage.completion_tokens
    assert short < 12
    longer = client.chat.completions.create(
        model="base", messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"min_tokens": 12}
    )
    assert longer.usage is not None and longer.usage.completion_tokens >= 12
    text = ended.choices[0].message.content or ""
    assert (longer.choices[0].message.content or "").startswith(text) and len(
        longer.choices[0].message.content or ""
    ) > len(text)


def test_a_shared_system_prompt_is_reported_as_cached_tokens(client: openai.OpenAI, gateway: ServerProcess) -> None:
    system = "You answer questions about lighthouses: their keepers, lamps, lenses and the ships they guide."
    usages = []
    for question in ("Who keeps a lighthouse?", "What lens does a lighthouse use?"):
        messages: Any = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        reply = client.chat.completions.create(model="pirate", messages=messages, max_tokens=4, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        usages.append(reply.usage)
    # The first prompt has no start cached under this adapter; the second reads the system turn from the cache.
    assert usages[0].prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    cached = usages[1].prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached is not None and 16 <= cached < usages[1].prompt_tokens
    # Under a salt of its own (vLLM's cache_salt), the same prompt reads nothing cached under another.
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who keeps a lighthouse?"}]
    salted = client.chat.completions.create(
        model="pirate", messages=messages, max_tokens=4, temperature=0, extra_body={"cache_salt": "tenant-secret"}
    )
    assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    # The replica's counters reach /metrics at its next Stats poll (every second).
    hits_line = 'adaptergate_engine_prefix_cache_hits_total{replica="engine-0"} '
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"{gateway.url}/metrics") as response:
            lines = [line for line in response.read().decode().splitlines() if line.startswith(hits_line)]
        if (lines and float(lines[0].split()[-1]) >= cached) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert lines and float(lines[0].split()[-1]) >= cached, lines


def _sampled(client: openai.OpenAI, model: str, seed: int, n: int = 1) -> ChatCompletion:
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=seed,
        n=n,
        extra_body=_comparable(),
    )


def _comparable() -> dict[str, object]:
    """Settings for sampled replies compared across requests. On the CPU a batch's composition (and keys read
    from the prefix cache rather than prefilled) changes the logits' last bits, and a draw over the whole
    vocabulary's long tail flips on that now and then (seen within 5 tokens); over the top 5 tokens it would
    take a draw within ~1e-6 of a boundary. A cache salt of its own has the prompt prefilled whole."""
    return {"top_k": 5, "cache_salt": uuid.uuid4().hex}


def test_n_seeded_choices_differ_and_each_is_the_single_request_with_seed_plus_i(client: openai.OpenAI) -> None:
    reply = _sampled(client, "base", 11, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) == 3, texts
    # The single requests run together, as the choices do: on the CPU a batch of one and one of three round the
    # logits differently, enough for a draw at temperature 1 to pick another token now and then.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        singles = list(pool.map(lambda i: _sampled(client, "base", 11 + i), range(3)))
    assert texts == [s.choices[0].message.content for s in singles]
    assert [c.finish_reason for c in reply.choices] == [s.choices[0].finish_reason for s in singles]
    usages = [s.usage for s in singles if s.usage is not None]
    assert reply.usage is not None and len(usages) == 3
    assert reply.usage.prompt_tokens == usages[0].prompt_tokens
    assert reply.usage.completion_tokens == sum(u.completion_tokens for u in usages)


def test_n_greedy_choices_are_identical(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="base", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=2)
    single = client.completions.create(model="base", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in reply.choices] == [single.choices[0].text] * 2


def test_n_streamed_choices_are_the_whole_replys(client: openai.OpenAI) -> None:
    whole = _sampled(client, DEMO_ADAPTERS[0], 5, n=2)
    stream = client.chat.completions.create(
        model=DEMO_ADAPTERS[0],
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=_comparable(),
    )
    chunks = list(stream)
    texts = ["", ""]
    reasons: list[list[str | None]] = [[], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        reasons[choice.index].append(choice.finish_reason)
    assert texts == [c.message.content for c in whole.choices]
    assert [r[-1] for r in reasons] == [c.finish_reason for c in whole.choices]
    assert all(r.count(None) == len(r) - 1 for r in reasons)  # one finish_reason per choice, at its end
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    # The token counts, not the cached ones: the two choices of a request share its cache salt, so whether one
    # read the prompt from the prefix cache the other had written depends on the steps they were admitted in
    # (a fresh-clone run saw the two usages differ where texts and finish reasons agreed).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(chunks[-1].usage, c) for c in counts] == [getattr(whole.usage, c) for c in counts]


def _single_token_id(text: str) -> int:
    """The id of the token that is `text` on its own."""
    ids = _tokenizer().encode(text)
    assert len(ids) == 1 and _tokenizer().piece(ids[0])[0] == text, (text, ids)
    return ids[0]


def test_a_stop_token_ends_the_reply_right_there_whole_and_streamed(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = _completion_tokens(client, prompt, max_tokens=12)
    k = next(k for k in range(2, len(plain)) if plain[k] not in plain[:k] and plain[k].strip())
    stop = _single_token_id(plain[k])
    for include in (False, True):
        request: dict[str, Any] = {
            "model": "base",
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "extra_body": {"stop_token_ids": [stop], "include_stop_str_in_output": include},
        }
        reply = client.completions.create(**request, logprobs=0)
        choice = reply.choices[0]
        # Its text is left out unless asked for; it is counted, and has its logprobs, either way (vLLM's rule).
        assert choice.text == "".join(plain[: k + 1 if include else k]) and choice.finish_reason == "stop"
        assert reply.usage is not None and reply.usage.completion_tokens == k + 1
        assert choice.logprobs is not None and choice.logprobs.tokens == plain[: k + 1]
        chunks = list(client.completions.create(**request, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string_whole_and_streamed(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    full = _greedy(client, "base")
    assert "Paris" in full
    for include in (False, True):
        request: dict[str, Any] = {
            "model": "base",
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stop": ["Paris"],
            "extra_body": {"include_stop_str_in_output": include},
        }
        expected = full[: full.index("Paris") + (len("Paris") if include else 0)]
        reply = client.chat.completions.create(**request)
        assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(**request, stream=True))
        parts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(parts) == expected  # nothing past the stop string (or its end) was ever streamed
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_ignore_eos_runs_past_the_end_token_up_to_max_tokens(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    ended = client.chat.completions.create(model="base", messages=messages, max_tokens=40, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage is not None and ended.usage.completion_tokens < 40
    for stream in (False, True):
        request: dict[str, Any] = {"model": "base", "messages": messages, "max_tokens": 40, "temperature": 0}
        if stream:
            chunks = list(
                client.chat.completions.create(
                    **request, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            reply = client.chat.completions.create(**request, extra_body={"ignore_eos": True})
            text, finish, usage = reply.choices[0].message.content or "", reply.choices[0].finish_reason, reply.usage
        assert finish == "length" and usage is not None and usage.completion_tokens == 40
        assert text.startswith(ended.choices[0].message.content or "") and len(text) > len(
            ended.choices[0].message.content or ""
        )


def test_stop_token_ids_past_the_vocabulary_are_a_400(client: openai.OpenAI) -> None:
    vocab = _tokenizer().vocab_size
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=rf"\[{vocab}\] in stop_token_ids contain out-of-vocab"):
            client.completions.create(
                model="base", prompt="x", max_tokens=2, stream=stream, extra_body={"stop_token_ids": [5, vocab]}
            )
    with pytest.raises(openai.BadRequestError, match="stop_token_ids must be an array") as refused:
        client.completions.create(model="base", prompt="x", max_tokens=2, extra_body={"stop_token_ids": [-5]})
    assert refused.value.param == "stop_token_ids"
    reply = client.completions.create(
        model="base", prompt="x", max_tokens=2, extra_body={"stop_token_ids": [vocab - 1]}
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_engine_refusals_keep_their_meaning(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="adapter 'kraken' not found"):
        _greedy(client, "kraken")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens; the prompt has"):
        _greedy(client, "base", prompt="word " * 2000)  # beyond max_model_len 512


def test_restart_keeps_registry(gateway: ServerProcess, tmp_path: Path) -> None:
    # The registry file written on first start is what a restart would read: it holds every demo adapter.
    from gateway.registry import Registry

    path = next(Path(gateway.log_path).parent.glob("registry.db"))
    registry = Registry.open(str(path))
    try:
        assert sorted(i.name for i in registry.list()) == sorted(DEMO_ADAPTERS)
    finally:
        registry.close()


def test_manifest_with_a_bad_source_is_refused_and_not_stored(gateway: ServerProcess, tmp_path: Path) -> None:
    manifest = {
        "apiVersion": "adapter.ai/v1",
        "kind": "AdapterInstance",
        "metadata": {"name": "ghost"},
        "spec": {
            "baseModel": "smollm2-135m-instruct",
            "versions": [{"name": "v1", "source": str(tmp_path / "missing"), "weight": 100}],
        },
    }
    status, reply = http_json("POST", f"{gateway.url}/admin/adapters", {"manifests": [manifest]})
    assert status == 400
    assert "adapter_config.json" in reply["error"]["message"]
    assert http_json("GET", f"{gateway.url}/admin/adapters/ghost")[0] == 404


# Long enough for the prefix cache (blocks of 16 tokens) to hold most of it once it has been sent.
SCORED = (
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid. "
    "The capital of Germany is Berlin."
)


def _check_prompt_logprobs(positions: list[Any], ids: list[int], top: int) -> None:
    """vLLM's prompt_logprobs of a prompt of `ids` against the reference model's own log_softmax."""
    reference = _reference(tuple(ids))  # row q: the distribution of token q + 1
    assert len(positions) == len(ids) and positions[0] is None
    for q, (position, token) in enumerate(zip(positions[1:], ids[1:], strict=True)):
        row = reference[q]
        listed = list(position)
        assert listed[0] == str(token)  # the prompt token first (vLLM's order)
        own = position[str(token)]
        assert own["logprob"] == pytest.approx(float(row[token]), abs=2e-3)
        assert own["decoded_token"] == _tokenizer().piece(token)[0]
        # Its rank in the reference, where no other token lies within float noise of it.
        close = int(((row - row[token]).abs() < 1e-3).sum())
        if close == 1:
            assert own["rank"] == int((row >= row[token]).sum())
        best = row.topk(top)
        others = [position[str(i)]["logprob"] for i in best.indices.tolist()]
        assert others == pytest.approx(best.values.tolist(), abs=2e-3)
        assert len(position) in (top, top + 1)


def test_prompt_logprobs_are_the_models_own_even_for_a_cached_prompt(client: openai.OpenAI) -> None:
    ids = _tokenizer().encode(SCORED)
    salt = {"cache_salt": uuid.uuid4().hex}  # a prefix cache of its own: other tests' prompts do not count
    warm = client.completions.create(model="base", prompt=SCORED, max_tokens=1, temperature=0, extra_body=salt)
    again = client.completions.create(model="base", prompt=SCORED, max_tokens=1, temperature=0, extra_body=salt)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0 and warm.choices[0].text == again.choices[0].text
    # The same prompt with prompt_logprobs: prefilled whole (no cached start), every position's values.
    reply = client.completions.create(
        model="base", prompt=SCORED, max_tokens=1, temperature=0, extra_body={**salt, "prompt_logprobs": 3}
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    choice = reply.choices[0]
    assert choice.text == warm.choices[0].text  # the completion is unchanged
    _check_prompt_logprobs((choice.model_extra or {})["prompt_logprobs"], ids, 3)


def test_chat_prompt_logprobs_are_a_field_of_the_reply(client: openai.OpenAI) -> None:
    from tests.support.hf_reference import chat_prompt_ids

    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(
        model="base", messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    _check_prompt_logprobs((reply.model_extra or {})["prompt_logprobs"], chat_prompt_ids(messages), 2)


def test_echo_scores_a_text_as_lm_evaluation_harness_asks(client: openai.OpenAI) -> None:
    """echo with logprobs: the prompt's text and its tokens' logprobs (the first null) before the completion's;
    with max_tokens 0 the prompt alone (a text's score), streamed or not."""
    ids = _tokenizer().encode(SCORED)
    reference = _reference(tuple(ids))
    want = [float(reference[q][t]) for q, t in enumerate(ids[1:])]
    scored = client.completions.create(model="base", prompt=SCORED, echo=True, logprobs=1, max_tokens=0)
    choice = scored.choices[0]
    logprobs = choice.logprobs
    assert choice.text == SCORED and choice.finish_reason == "length"
    assert logprobs is not None and logprobs.tokens == [_tokenizer().piece(t)[0] for t in ids]
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    assert all(len(top) in (1, 2) for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]
    assert scored.usage is not None and (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    # lm-evaluation-harness's own request: one greedy token more, whose entry comes last.
    harness = client.completions.create(model="base", prompt=SCORED, echo=True, logprobs=1, max_tokens=1, temperature=0)
    h = harness.choices[0]
    assert h.logprobs is not None and h.logprobs.token_logprobs is not None and h.logprobs.tokens is not None
    assert h.text.startswith(SCORED) and len(h.logprobs.tokens) == len(ids) + 1
    assert h.logprobs.token_logprobs[1:-1] == pytest.approx(want, abs=2e-3)
    assert h.text == SCORED + h.logprobs.tokens[-1]
    for max_tokens in (0, 3):
        stream = client.completions.create(
            model="base", prompt=SCORED, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0, stream=True
        )
        chunks = [c.choices[0] for c in stream if c.choices]
        whole = client.completions.create(
            model="base", prompt=SCORED, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
        ).choices[0]
        assert chunks[0].text.startswith(SCORED) and "".join(c.text for c in chunks) == whole.text
        streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs or []]
        assert whole.logprobs is not None and whole.logprobs.token_logprobs is not None
        assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)
