"""vLLM's `prompt_logprobs` and OpenAI's `echo` over REST: what the engine is asked for, and where the prompt's
log-probabilities go in chat and completion replies, whole and streamed (vLLM's serving_completion.py)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.api import Done, Event, GatewayRequest, PromptLogprobs, TokenChunk, TokenLogprob, TokenLogprobs, Usage
from protocols.rest import RestServer
from tests.unit.protocols.test_openapi import _conforms, _ref
from tests.unit.protocols.test_rest import FakeGateway, _chat
from tests.unit.protocols.test_rest_logprobs import _post

PROMPT = "The cat sat"
# The prompt's tokens: (id, text, logprob given the tokens before it, rank); the first has none.
PROMPT_TOKENS = [(10, "The", None, None), (11, " cat", -2.5, 4), (12, " sat", -math.inf, 90)]
# Most likely tokens at each position past the first: the second's prompt token is among them.
TOPS = [[(20, " dog", -0.5), (21, " man", -1.0), (11, " cat", -2.5)], [(22, " on", -0.25), (23, " down", -1.5)]]
COMPLETION = [("!", -0.75)]


def _token(token_id: int, text: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(text, text.encode(), logprob, token_id)


def prompt_logprobs(top: int) -> PromptLogprobs:
    rest = tuple(
        TokenLogprobs(_token(i, t, lp or 0.0), tuple(_token(*x) for x in tops[:top]))
        for (i, t, lp, _), tops in zip(PROMPT_TOKENS[1:], TOPS, strict=True)
    )
    first = _token(PROMPT_TOKENS[0][0], PROMPT_TOKENS[0][1], 0.0)
    return PromptLogprobs(first, rest, tuple(r for *_, r in PROMPT_TOKENS[1:] if r is not None))


class PromptGateway(FakeGateway):
    """Completes with `COMPLETION` (none with max_tokens 0), the prompt's log-probabilities on the first event
    when the request asks, made-up sampled-token log-probabilities when it asks for those."""

    async def submit(self, request: GatewayRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        s = request.sampling
        prompt = None if s.prompt_logprobs is None else prompt_logprobs(s.prompt_logprobs)
        if s.max_tokens == 0:
            yield Done("length", Usage(3, 0), prompt_logprobs=prompt)
            return
        for text, lp in COMPLETION:
            entries = () if s.logprobs is None else (TokenLogprobs(_token(30, text, lp), (_token(30, text, lp),)),)
            yield TokenChunk(text, 1, None, entries, prompt)
            prompt = None
        yield Done("length", Usage(3, len(COMPLETION)))


@pytest.fixture
async def served() -> AsyncIterator[tuple[PromptGateway, str]]:
    gateway = PromptGateway()
    async with RestServer(gateway, port=0, model_name="smol", health=gateway) as server:
        yield gateway, f"http://127.0.0.1:{server.port}"


def vllm_prompt_logprobs(top: int) -> list[Any]:
    """vLLM's prompt_logprobs of the scripted prompt: null, then per token id its logprob, rank and text, the prompt
    token first, then the `top` most likely (the prompt token once, in its first place)."""
    out: list[Any] = [None]
    for (token_id, text, lp, rank), tops in zip(PROMPT_TOKENS[1:], TOPS, strict=True):
        position = {str(token_id): {"logprob": max(lp or 0.0, -9999.0), "rank": rank, "decoded_token": text}}
        for r, (i, t, v) in enumerate(tops[:top], start=1):
            position.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": t})
        out.append(position)
    return out


@pytest.mark.parametrize("top", [0, 2, 3])
async def test_completion_choices_carry_the_prompt_logprobs(served: tuple[PromptGateway, str], top: int) -> None:
    gateway, url = served
    reply = await _post(url, "/v1/completions", {"model": "base", "prompt": PROMPT, "prompt_logprobs": top, "n": 2})
    assert [r.sampling.prompt_logprobs for r in gateway.requests] == [top, top]
    for choice in reply["choices"]:
        assert choice["prompt_logprobs"] == vllm_prompt_logprobs(top)
        assert choice["text"] == "!" and choice["logprobs"] is None
    assert list(reply["choices"][0]["prompt_logprobs"][1]) == (["11", "20", "21"] if top >= 2 else ["11"])[: top + 1]


async def test_chat_replies_carry_the_prompt_logprobs_beside_the_choices(served: tuple[PromptGateway, str]) -> None:
    gateway, url = served
    reply = await _post(url, "/v1/chat/completions", _chat(prompt_logprobs=1, logprobs=True))
    assert gateway.requests[0].sampling.prompt_logprobs == 1
    assert reply["prompt_logprobs"] == vllm_prompt_logprobs(1)
    assert "prompt_logprobs" not in reply["choices"][0]
    assert reply["choices"][0]["logprobs"]["content"][0]["token"] == "!"


async def test_replies_without_prompt_logprobs_have_no_such_field(served: tuple[PromptGateway, str]) -> None:
    gateway, url = served
    chat = await _post(url, "/v1/chat/completions", _chat())
    text = await _post(url, "/v1/completions", {"model": "base", "prompt": PROMPT})
    assert "prompt_logprobs" not in chat and "prompt_logprobs" not in text["choices"][0]
    assert [r.sampling.prompt_logprobs for r in gateway.requests] == [None, None]


def echoed_logprobs(top: int, completion: bool) -> dict[str, Any]:
    """The completion `logprobs` object of an echo: the prompt's tokens (the first with nulls), then the
    completion's; top_logprobs hold each position's `top` most likely and its own token."""
    tokens = [t for _, t, _, _ in PROMPT_TOKENS] + (["!"] if completion else [])
    tops: list[Any] = [None]
    for (_, text, lp, _), alternatives in zip(PROMPT_TOKENS[1:], TOPS, strict=True):
        tops.append({t: v for _, t, v in alternatives[:top]} | {text: max(lp or 0.0, -9999.0)})
    values = [None, -2.5, -9999.0] + ([-0.75] if completion else [])
    offsets = [0, 3, 7] + ([11] if completion else [])
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops + ([{"!": -0.75}] if completion else []),
        "text_offset": offsets,
    }


async def test_echo_with_max_tokens_0_scores_the_prompt(served: tuple[PromptGateway, str]) -> None:
    """lm-evaluation-harness's loglikelihood request, as vLLM answers it: the prompt and its tokens' logprobs."""
    gateway, url = served
    body = {"model": "base", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    reply = await _post(url, "/v1/completions", body)
    sent = gateway.requests[0].sampling
    assert (sent.max_tokens, sent.prompt_logprobs, sent.logprobs) == (0, 1, 1)
    choice = reply["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    assert choice["logprobs"] == echoed_logprobs(1, completion=False)
    assert "prompt_logprobs" not in choice  # the client did not ask for vLLM's field
    assert reply["usage"]["completion_tokens"] == 0


async def test_echo_puts_the_prompt_before_the_completion(served: tuple[PromptGateway, str]) -> None:
    gateway, url = served
    body = {"model": "base", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 1, "prompt_logprobs": 1}
    reply = await _post(url, "/v1/completions", body)
    # The engine is asked for the most top tokens either wants; each field gets its own count.
    assert gateway.requests[0].sampling.prompt_logprobs == 2
    choice = reply["choices"][0]
    assert choice["text"] == PROMPT + "!"
    assert choice["logprobs"] == echoed_logprobs(2, completion=True)
    assert choice["prompt_logprobs"] == vllm_prompt_logprobs(1)


async def test_echo_without_logprobs_asks_the_engine_for_nothing_more(served: tuple[PromptGateway, str]) -> None:
    gateway, url = served
    reply = await _post(url, "/v1/completions", {"model": "base", "prompt": PROMPT, "echo": True, "max_tokens": 3})
    assert gateway.requests[0].sampling.prompt_logprobs is None
    assert reply["choices"][0]["text"] == PROMPT + "!" and reply["choices"][0]["logprobs"] is None
    reply = await _post(url, "/v1/completions", {"model": "base", "prompt": PROMPT, "echo": True, "max_tokens": 0})
    assert gateway.requests[1].sampling.prompt_logprobs == 0  # the engine's prompt-only mode needs them
    assert reply["choices"][0]["text"] == PROMPT and reply["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("max_tokens", [0, 1])
async def test_a_streamed_echo_sends_the_prompt_first(served: tuple[PromptGateway, str], max_tokens: int) -> None:
    _, url = served
    body = {"model": "base", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": max_tokens, "stream": True}
    chunks = await _post(url, "/v1/completions", body)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[0].startswith(PROMPT) and "".join(texts) == PROMPT + "!" * max_tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key, values in (chunk["choices"][0]["logprobs"] or {}).items():
            merged[key] += values
    assert merged == echoed_logprobs(2, completion=max_tokens == 1)


@pytest.mark.parametrize(
    ("path", "body", "name"),
    [
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}, "Completion"),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, "prompt_logprobs": 2}, "Completion"),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, "stream": True}, "CompletionChunk"),
        ("/v1/chat/completions", _chat(prompt_logprobs=3), "ChatCompletion"),
    ],
)
async def test_replies_match_the_document(
    served: tuple[PromptGateway, str], path: str, body: dict[str, Any], name: str
) -> None:
    _, url = served
    reply = await _post(url, path, {**body, "model": "base"})
    for event in reply if isinstance(reply, list) else [reply]:
        assert _conforms(_ref(name), event), event
