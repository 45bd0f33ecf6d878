"""The official `openai` client, unchanged, against a real gateway process over the fast engine fixture."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import (
    DEV_KEY,
    FAST_ENGINE_SCRIPT,
    ServerProcess,
    gateway_config,
    http_json,
    manifest,
    start_gateway,
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("openai-client")
    config = gateway_config(
        engines={"local": {"count": 1, "command": [sys.executable, str(FAST_ENGINE_SCRIPT), "--chunks", "5"]}},
        registry={"path": str(workdir / "registry.db"), "seed_demo_adapters": False},
    )
    server = start_gateway(config, workdir)
    status, _ = http_json("POST", f"{server.url}/admin/adapters", {"manifests": [manifest("pirate", ("v1", "/x", 1))]})
    assert status == 200, server.log()
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture
def client(gateway: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=DEV_KEY, max_retries=0)


def test_chat_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="pirate", messages=[{"role": "user", "content": "Ahoy?"}], max_tokens=3, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "tok tok tok "
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert reply.model == "pirate"


def test_chat_completion_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="base:pirate",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok " * 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_completions_plain_and_streamed(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="base", prompt="Once upon", max_tokens=2)
    assert reply.choices[0].text == "tok tok "
    streamed = client.completions.create(model="base", prompt="Once upon", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "tok " * 5


def test_several_choices_whole_and_streamed(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="base", prompt="Once upon", max_tokens=2, n=3, best_of=1)
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == [(i, "tok tok ", "length") for i in range(3)]
    assert reply.usage is not None and reply.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="pirate", messages=[{"role": "user", "content": "hi"}], n=2, stream=True
    )
    texts = ["", ""]
    for chunk in stream:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
    assert texts == ["tok " * 5] * 2


def test_logprobs_chat_and_completions_whole_and_streamed(client: openai.OpenAI) -> None:
    # The fixture engine makes them up: each "tok " at -0.25, the most likely, then "alt1" at -1.0, ...
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(
        model="pirate", messages=messages, max_tokens=3, logprobs=True, top_logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == 3
    for entry in logprobs.content:
        assert (entry.token, entry.logprob, entry.bytes) == ("tok ", -0.25, list(b"tok "))
        assert [(t.token, t.logprob, t.bytes) for t in entry.top_logprobs] == [
            ("tok ", -0.25, list(b"tok ")),
            ("alt1", -1.0, list(b"alt1")),
        ]
    stream = client.chat.completions.create(
        model="pirate", messages=messages, max_tokens=3, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert streamed == logprobs.content
    completion = client.completions.create(model="base", prompt="Once upon", max_tokens=2, logprobs=1)
    text = completion.choices[0].logprobs
    assert text is not None
    assert (text.tokens, text.token_logprobs, text.text_offset) == (["tok ", "tok "], [-0.25, -0.25], [0, 4])
    assert text.top_logprobs == [{"tok ": -0.25}] * 2
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20") as refused:
        client.chat.completions.create(model="base", messages=messages, logprobs=True, top_logprobs=21)
    assert refused.value.param == "top_logprobs"


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["base", "pirate"]


def test_errors_raise_the_matching_openai_exceptions(client: openai.OpenAI, gateway: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError, match="adapter 'kraken' not found"):
        client.chat.completions.create(model="kraken", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="n must be at most 16, got 17") as refused:
        client.chat.completions.create(model="base", messages=[{"role": "user", "content": "x"}], n=17)
    assert refused.value.param == "n"
    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        bad.models.list()


async def test_async_client_streams(gateway: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=DEV_KEY, max_retries=0)
    async with client:
        stream = await client.chat.completions.create(
            model="pirate", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=2
        )
        parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    assert parts == ["tok ", "tok "]


@pytest.mark.parametrize("model", ["base", "pirate", "base:pirate"])
def test_every_usable_model_name_can_be_retrieved(client: openai.OpenAI, model: str) -> None:
    # "base:pirate" served completions but models.retrieve("base:pirate") was a 404.
    assert client.models.retrieve(model).id == model
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert reply.model == model


def test_vllm_extras_are_refused_unless_they_change_nothing(client: openai.OpenAI) -> None:
    # vLLM clients send these through extra_body; they were ignored, changing the answer unannounced.
    messages = [{"role": "user", "content": "x"}]
    for name, value in (("use_beam_search", True), ("structured_outputs", {"choice": ["a"]})):
        with pytest.raises(openai.BadRequestError, match=f"{name} is not supported") as refused:
            client.chat.completions.create(model="base", messages=messages, extra_body={name: value})
        assert refused.value.param == name
    no_ops = {"use_beam_search": False, "guided_choice": None, "top_k": -1}
    reply = client.completions.create(model="base", prompt="x", max_tokens=2, extra_body=no_ops)
    assert reply.choices[0].text == "tok tok "


def test_penalties_logit_bias_and_vllm_sampling_extras_are_accepted_within_their_ranges(client: openai.OpenAI) -> None:
    # They were refused unless they changed nothing (the engine applies them: test_rest_real_engine.py).
    messages: Any = [{"role": "user", "content": "x"}]
    extras = {
        "repetition_penalty": 1.2,
        "min_p": 0.05,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [7, 8],
        "include_stop_str_in_output": True,
    }
    reply = client.chat.completions.create(
        model="base",
        messages=messages,
        max_tokens=2,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={"5": 10, "50256": -100},
        extra_body=extras,
    )
    assert reply.choices[0].message.content == "tok tok "
    for name, value in (
        ("frequency_penalty", 2.5),
        ("repetition_penalty", 0),
        ("min_p", 2),
        ("min_tokens", 3),
        ("ignore_eos", "yes"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["7"]),
        ("include_stop_str_in_output", 1),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="base", prompt="x", max_tokens=2, extra_body={name: value})
        assert refused.value.param == name
    with pytest.raises(openai.BadRequestError, match="between -100 and 100") as refused:
        client.completions.create(model="base", prompt="x", logit_bias={"5": 101})
    assert refused.value.param == "logit_bias"
