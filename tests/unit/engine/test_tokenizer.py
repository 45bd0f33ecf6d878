"""Streaming detokenization with the shipped SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from engine.loader import resolve_model
from engine.tokenizer import IncrementalDecoder, Tokenizer

TEXT = "The sea is vast, 深い海 🌊 and full of life: naïve café, 바다! " * 3


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model("smollm2"))


def test_deltas_add_up_to_the_decoded_completion(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.push(t) for t in ids]
    assert "".join(deltas) == decoder.text == tokenizer.decode(ids) == TEXT


def test_a_character_split_over_tokens_comes_out_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🌊")
    assert len(ids) > 1  # byte-level pieces of one character
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1]) == "🌊"


def test_special_and_unknown_ids_add_no_text(tokenizer: Tokenizer) -> None:
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push(next(iter(tokenizer.eos_token_ids))) == ""
    assert decoder.push(tokenizer.vocab_size + 7) == ""  # a padded LM head can sample past the vocabulary
    assert decoder.push(tokenizer.encode(" sea")[0]) == " sea"


def test_a_token_does_not_decode_the_whole_completion_again(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Re-decoding everything per token made each token's cost grow with the completion (quadratic per
    request): 0.7 ms per token at 4000 tokens, on the engine thread."""
    ids = tokenizer.encode(TEXT)

    def refuse(_: object) -> str:
        raise AssertionError("decoded the whole completion")

    monkeypatch.setattr(tokenizer, "decode", refuse)
    decoder = IncrementalDecoder(tokenizer)
    for t in ids:
        decoder.push(t)
    assert decoder.text == TEXT


# Mistral's and Llama 2's templates refuse chats whose roles do not alternate, like this one.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ m['content'] }}{% endfor %}"
)


def test_a_chat_the_template_refuses_is_a_value_error(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The template's refusal came out as jinja's TemplateError: the server, which turns ValueError into
    INVALID_ARGUMENT, failed the call as UNKNOWN with no reason a client could act on."""
    monkeypatch.setattr(tokenizer._tok, "chat_template", STRICT_TEMPLATE)
    assert tokenizer.encode_chat([("user", "a"), ("assistant", "b"), ("user", "c")])
    with pytest.raises(ValueError, match="roles must alternate"):
        tokenizer.encode_chat([("user", "a"), ("user", "b")])
