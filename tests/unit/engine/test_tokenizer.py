"""Streaming detokenization with the shipped SmolLM2 tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.loader import ModelSource, resolve_model
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


def test_token_pieces_add_up_to_the_text_and_name_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    pieces = [tokenizer.piece(t) for t in ids]
    assert b"".join(raw for _, raw in pieces) == TEXT.encode()  # pieces of a character included
    assert [text for text, _ in pieces[:4]] == ["The", " sea", " is", " vast"]
    wave = [tokenizer.piece(t) for t in tokenizer.encode(" 🌊")]
    assert len(wave) > 1 and all("\ufffd" in text for text, _ in wave)  # no piece is a character alone
    eos = next(iter(tokenizer.eos_token_ids))
    assert tokenizer.piece(eos) == ("<|im_end|>", b"<|im_end|>")
    assert tokenizer.piece(tokenizer.vocab_size + 7) == ("", b"")  # a padded LM head's extra rows


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


def _llama_like(folder: Path, generation_config: dict[str, object] | None) -> Tokenizer:
    """A Hugging Face model folder whose tokenizer, like Llama 2's, puts a BOS before every input and marks
    word starts with "▁" (SentencePiece), the first word's dropped when decoding."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    folder.mkdir()
    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "<unk>": 3, "▁hi": 4, "▁sea": 5, "▁is": 6, "▁blue": 7}
    backend = Backend(models.WordLevel(vocab, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<eot>")])
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 1}))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return Tokenizer(ModelSource(folder, "hf"))


def test_the_generation_configs_end_tokens_end_a_completion(tmp_path: Path) -> None:
    """Only the tokenizer's EOS was an end token: a chat model whose turns end with another (Llama 3's
    <|eot_id|>, listed in generation_config.json) ran on past its reply to max_tokens."""
    assert _llama_like(tmp_path / "listed", {"eos_token_id": [1, 2]}).eos_token_ids == {1, 2}
    assert _llama_like(tmp_path / "one", {"eos_token_id": 2}).eos_token_ids == {1, 2}
    assert _llama_like(tmp_path / "none", None).eos_token_ids == {1}  # config.json's, the tokenizer's too
    # A generation config that names no end tokens leaves config.json's.
    _llama_like(tmp_path / "silent", {"do_sample": True})
    (tmp_path / "silent" / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [1, 2]}))
    assert Tokenizer(ModelSource(tmp_path / "silent", "hf")).eos_token_ids == {1, 2}
    # One that sets them to null names none either (it once hid config.json's).
    _llama_like(tmp_path / "null", {"eos_token_id": None})
    (tmp_path / "null" / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [1, 2]}))
    assert Tokenizer(ModelSource(tmp_path / "null", "hf")).eos_token_ids == {1, 2}


def test_a_plain_prompt_gets_the_bos_its_tokenizer_adds_and_a_chat_no_second_one(tmp_path: Path) -> None:
    """Plain prompts were encoded without special tokens: a Llama or Mistral model saw no BOS."""
    tokenizer = _llama_like(tmp_path / "m", None)
    assert tokenizer.encode("hi sea") == [0, 4, 5]
    tokenizer._tok.chat_template = "<s>{% for m in messages %} {{ m['content'] }}{% endfor %}"
    assert tokenizer.encode_chat([("user", "hi sea")]) == [0, 4, 5]


def test_the_first_word_of_a_completion_keeps_its_space(tmp_path: Path) -> None:
    """A SentencePiece decoder drops the space of a text's first word: decoded without the prompt before it,
    "The sea is" + " blue" came out as "The sea isblue"."""
    tokenizer = _llama_like(tmp_path / "m", None)
    prompt = tokenizer.encode("hi sea is")
    decoder = IncrementalDecoder(tokenizer, prompt)
    assert [decoder.push(t) for t in tokenizer.encode("blue sea")[1:]] == [" blue", " sea"]
    assert decoder.text == " blue sea"
    assert IncrementalDecoder(tokenizer).push(7) == "blue"  # no prompt: a text of its own
