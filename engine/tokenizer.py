"""Tokenizer and chat template from the model's own source, through `transformers`' fast tokenizers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from tokenizers.decoders import DecodeStream

from engine.loader import ModelSource, cache_dir


class Tokenizer:
    """Encode prompts, render chat messages, decode completions incrementally."""

    def __init__(self, source: ModelSource) -> None:
        from transformers import AutoTokenizer

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
        eos = self._tok.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset([] if eos is None else [int(eos)])
        self.vocab_size = len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template, ready for the reply; raises
        ValueError for a chat the template cannot render."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt")
        try:
            rendered = self._tok.apply_chat_template(
                [{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=True,
                tokenize=False,
            )
        except TemplateError as exc:  # the template's own refusal (`raise_exception`), e.g. roles out of turn
            raise ValueError(f"the model's chat template refused these messages: {exc}") from exc
        return self.encode(str(rendered))

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` inside (what `DecodeStream` steps with)."""
        return self._tok.backend_tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 characters.

    `tokenizers`' `DecodeStream` keeps a few ids of context, so a token costs about a microsecond
    whatever the completion's length. Decoding the whole completion again for each token (as before)
    cost 0.2-0.7 ms per token per request at 1000-4000 tokens on the engine thread
    (`bench/detokenize.py`).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        delta = self._stream.step(self._backend, token_id)
        if not delta:
            return ""
        self.text += delta
        return str(delta)
