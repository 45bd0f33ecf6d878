"""vLLM's /tokenize and /detokenize through `adaptergate serve` and the real engine (SmolLM2, the demo adapters):
the tokens a completion's prompt is, and back."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import DEV_KEY, ServerProcess, http_json
from tests.integration.test_rest_real_engine import serve_real_engine

pytestmark = pytest.mark.slow

PROMPT = "The sea is vast, 深い海 🌊 and full of life."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve_real_engine(tmp_path_factory)


@pytest.fixture
def url(gateway: ServerProcess) -> str:
    return gateway.url


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return http_json("POST", f"{url}{path}", body, timeout_s=120)  # type: ignore[no-any-return]


def test_a_prompt_tokenizes_and_detokenizes_back(url: str) -> None:
    status, reply = _post(url, "/tokenize", {"model": "pirate", "prompt": PROMPT, "return_token_strs": True})
    assert status == 200, reply
    assert reply["count"] == len(reply["tokens"]) == len(reply["token_strs"]) > 0
    assert reply["max_model_len"] == 512
    assert reply["token_strs"][1] == "Ġsea"
    status, back = _post(url, "/detokenize", {"model": "pirate", "tokens": reply["tokens"]})
    assert (status, back) == (200, {"prompt": PROMPT})
    status, completion = _post(url, "/v1/completions", {"model": "pirate", "prompt": PROMPT, "max_tokens": 1})
    assert status == 200, completion
    assert completion["usage"]["prompt_tokens"] == reply["count"]


def test_a_chat_tokenizes_as_a_chat_completions_prompt(url: str) -> None:
    status, reply = _post(url, "/tokenize", {"model": "base", "messages": CHAT})
    assert status == 200, reply
    assert reply["token_strs"] is None
    status, chat = _post(url, "/v1/chat/completions", {"model": "base", "messages": CHAT, "max_tokens": 1})
    assert status == 200, chat
    assert chat["usage"]["prompt_tokens"] == reply["count"]
    status, back = _post(url, "/detokenize", {"model": "base", "tokens": reply["tokens"]})
    assert status == 200
    assert back["prompt"].endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    status, closed = _post(url, "/tokenize", {"model": "base", "messages": CHAT, "add_generation_prompt": False})
    assert status == 200 and closed["tokens"] == reply["tokens"][: closed["count"]] and closed["count"] < reply["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "base", "prompt": "x", "messages": CHAT}, 400, "messages"),
        ("/tokenize", {"model": "base"}, 400, "prompt"),
        ("/tokenize", {"model": "base", "prompt": 7}, 400, "prompt"),
        ("/tokenize", {"model": "base", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ("/detokenize", {"model": "base", "tokens": [504, 49152]}, 400, "tokens"),  # past SmolLM2's vocabulary
        ("/detokenize", {"model": "base", "tokens": []}, 400, "tokens"),
        ("/detokenize", {"model": "base", "tokens": ["504"]}, 400, "tokens"),
        ("/tokenize", {"model": "no-such-adapter", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "no-such-adapter", "tokens": [1]}, 404, "model"),
    ],
)
def test_bad_requests_name_their_field(url: str, path: str, body: dict[str, Any], status: int, param: str) -> None:
    got, reply = _post(url, path, body)
    assert (got, reply["error"]["param"]) == (status, param), reply


def test_an_id_past_the_vocabulary_is_named(url: str) -> None:
    status, reply = _post(url, "/detokenize", {"model": "base", "tokens": [504, 49152]})
    assert status == 400
    assert reply["error"]["message"] == "tokens[1] is 49152, outside the vocabulary [0, 49152)"


def test_bad_json_is_a_400(url: str) -> None:
    request = urllib.request.Request(f"{url}/tokenize", data=b'{"model": ', method="POST")
    request.add_header("Authorization", f"Bearer {DEV_KEY}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    assert b"not valid JSON" in refused.value.read()
