"""Tokenizer and chat template from the model's own source, through `transformers`' fast tokenizers."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from tokenizers.decoders import DecodeStream

from engine.loader import ModelSource, cache_dir


class Tokenizer:
    """Encode prompts, render chat messages, decode completions incrementally."""

    def __init__(self, source: ModelSource) -> None:
        from transformers import AutoTokenizer
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        # transformers logs a conversion notice for every GGUF tokenizer; it is noise in our logs.
        logging.getLogger("transformers").setLevel(logging.ERROR)
        if source.kind == "hf":
            self._tok: Any = AutoTokenizer.from_pretrained(str(source.path))
        else:
            # Converting a GGUF vocabulary takes seconds; keep the converted tokenizer next to the weights cache.
            cached = cache_dir(source) / "tokenizer"
            if (cached / "tokenizer.json").is_file():
                self._tok = AutoTokenizer.from_pretrained(str(cached))
            else:
                self._tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
                try:
                    self._tok.save_pretrained(str(cached))
                except OSError:
                    pass
        eos_ids = _generation_eos_ids(source.path) if source.kind == "hf" else set()
        if self._tok.eos_token_id is not None:
            eos_ids.add(int(self._tok.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.vocab_size = len(self._tok)
        self._special = frozenset(int(i) for i in self._tok.added_tokens_decoder)
        decoder = repr(self.backend.decoder)
        self._byte_level = decoder.startswith("ByteLevel")
        # GPT-2's byte-level BPE alphabet read backwards: the byte each vocabulary character stands for.
        self._byte_of_char = {char: byte for byte, char in bytes_to_unicode().items()} if self._byte_level else {}
        self._byte_fallback = "ByteFallback" in decoder
        self._pieces: dict[int, tuple[str, bytes]] = {}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain prompt, by default with the special tokens the tokenizer puts around every input
        (the BOS of Llama and Mistral), as the model saw its inputs in training; a model without them continues a
        prompt noticeably worse."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template, by default ready for the reply (the
        assistant's turn opened); raises ValueError for a chat the template cannot render."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt")
        try:
            rendered = self._tok.apply_chat_template(
                [{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except TemplateError as exc:  # the template's own refusal (`raise_exception`), e.g. roles out of turn
            raise ValueError(f"the model's chat template refused these messages: {exc}") from exc
        # The template writes the special tokens itself (a BOS among them): adding them again would double them,
        # so only a client that asks for them (vLLM's add_special_tokens on /tokenize) gets them.
        return list(self._tok.encode(str(rendered), add_special_tokens=add_special_tokens))

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each token as the vocabulary spells it ("Ġthe" for a byte-level BPE's " the"), as vLLM's /tokenize
        shows them."""
        return [str(piece) for piece in self._tok.convert_ids_to_tokens(list(ids))]

    @property
    def hf_tokenizer(self) -> Any:
        """The `transformers` tokenizer itself (what xgrammar reads the vocabulary from: engine/structured.py)."""
        return self._tok

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` inside (what `DecodeStream` steps with)."""
        return self._tok.backend_tokenizer

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; completions leave special tokens out, vLLM's /detokenize keeps them."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """One token on its own, as logprobs show it: its text and its bytes. The bytes of a completion's tokens
        add up to its UTF-8 text, while a token holding part of a character reads U+FFFD as text; special tokens
        read as themselves ("<|im_end|>"), and an id past the vocabulary (a padded LM head) as nothing."""
        known = self._pieces.get(token_id)
        if known is None:
            raw = self._bytes(token_id)
            known = self._pieces[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return known

    def _bytes(self, token_id: int) -> bytes:
        piece = self.backend.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if piece is None:
            return b""
        if token_id in self._special:
            return str(piece).encode()
        if self._byte_level and all(c in self._byte_of_char for c in piece):
            return bytes(self._byte_of_char[c] for c in piece)
        if self._byte_fallback:  # SentencePiece: "<0xE2>" is one byte, "▁" a space
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()
        return str(self._tok.decode([token_id])).encode()


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _generation_eos_ids(folder: Path) -> set[int]:
    """End-of-sequence ids of a Hugging Face model's generation config (its config.json's without one).

    Chat models list the token that ends a turn there besides the tokenizer's end of text (Llama 3's
    <|eot_id|>, Qwen2's <|im_end|>): with only the tokenizer's, a reply ran on past its turn to max_tokens.
    """
    for name in ("generation_config.json", "config.json"):
        try:
            config = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(config, dict) or config.get("eos_token_id") is None:
            continue
        eos = config["eos_token_id"]
        ids = eos if isinstance(eos, list) else [eos]
        return {i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0}
    return set()


_PROMPT_CONTEXT = 6  # prompt tokens decoded before a completion: enough for the last word and a split character


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 characters.

    `tokenizers`' `DecodeStream` keeps a few ids of context, so a token costs about a microsecond
    whatever the completion's length. Decoding the whole completion again for each token (as before)
    cost 0.2-0.7 ms per token per request at 1000-4000 tokens on the engine thread
    (`bench/detokenize.py`).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        """`prompt_ids`: the tokens the completion follows. A SentencePiece decoder (Llama 2's, Mistral's)
        drops the space of a text's first word, so decoded alone "The sea is" + " blue" read "The sea isblue";
        the stream steps through the prompt's last tokens first, and the completion decodes as it reads
        after them."""
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=True)
        for token_id in prompt_ids[-_PROMPT_CONTEXT:]:
            self._stream.step(self._backend, token_id)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        delta = self._stream.step(self._backend, token_id)
        if not delta:
            return ""
        self.text += delta
        return str(delta)
