"""Structured outputs: a reply held to a JSON schema, to any JSON object, to a regular expression, to one of a
list of strings, or to an EBNF grammar, by xgrammar (the library vLLM uses for the same).

A request names its constraint as (kind, spec) (`engine.sampling.STRUCTURED_KINDS`). `StructuredOutputs` compiles
it once against the engine's tokenizer (compiled grammars are cached by (kind, spec)), and each constrained
sequence holds a `Grammar`: the grammar's matcher, where the reply stands in it. Every step, for each
constrained row (`mask_logits`, before logit processing and sampling, greedy rows included):

    allowed = the tokens that may come next in the grammar (the end-of-sequence ids once it is complete)
    logits[t] = -inf  for every t not in allowed                      (on a copy: log-probabilities stay raw)

and each token a constrained sequence takes advances its matcher (`Grammar.accept`); the end-of-sequence token
that a complete grammar allows ends the request with "stop" (engine/outputs.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence as Rows
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.sequence import Sequence

# Compiled grammars kept for requests that repeat a constraint (a client's schema usually is the same each time).
_CACHED_GRAMMARS = 256
# xgrammar's C++ errors begin with a timestamp and a source position; the reason follows.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
# vLLM's words for a constraint xgrammar cannot compile, by kind (vllm/v1/structured_output/backend_xgrammar.py).
_FAILED = {
    "json_object": "Failed to transform json schema into a grammar",
    "json_schema": "Failed to transform json schema into a grammar",
    "regex": "Failed to transform regex into a grammar",
    "choice": "Failed to transform choices into a grammar",
    "grammar": "Invalid grammar specification",
}


class Grammar:
    """Where one request's reply stands in its grammar (an xgrammar `GrammarMatcher`)."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens that may come next into `bitmask`'s row `row` (a bit per token, 1: allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (and no move) if the grammar does not allow it here."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """Whether the reply took the end token of its complete grammar: nothing may follow."""
        return bool(self._matcher.is_terminated())


class StructuredOutputs:
    """Compiles constraints against the engine's tokenizer. Thread-safe: requests are admitted on any thread.

    The tokenizer's tables are built on the first constrained request, so that an engine serving none pays
    nothing for them.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """`vocab_size`: the model's (its logits' width), which may exceed the tokenizer's; the ids past the
        tokenizer's are never allowed."""
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def grammar(self, kind: str, spec: str) -> Grammar:
        """A fresh matcher of constraint (`kind`, `spec`); raises ValueError with xgrammar's reason for a spec it
        cannot compile."""
        return Grammar(self.compile(kind, spec))

    def compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        """The compiled grammar of (`kind`, `spec`), from the cache when it was compiled before (ValueError as
        `grammar`)."""
        key = (kind, spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiler = self._compiler or self._make_compiler()
        try:
            compiled = _compile(compiler, kind, spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's C++ errors arrive as RuntimeError
            reason = _CPP_PREFIX.sub("", str(exc)).strip()
            raise ValueError(f"{_FAILED[kind]}: {reason}" if reason else f"{_FAILED[kind]}.") from exc
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _make_compiler(self) -> xgr.GrammarCompiler:
        # Under the lock; the grammar that ends a reply ends it with the tokenizer's end-of-sequence ids.
        info = xgr.TokenizerInfo.from_huggingface(
            self._tokenizer.hf_tokenizer,
            vocab_size=self._vocab_size,
            stop_token_ids=sorted(self._tokenizer.eos_token_ids),
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=4)
        return self._compiler


def _compile(compiler: xgr.GrammarCompiler, kind: str, spec: str) -> xgr.CompiledGrammar:
    if kind == "json_object":  # vLLM's: the schema of any object
        return compiler.compile_json_schema('{"type": "object"}')
    if kind == "json_schema":
        return compiler.compile_json_schema(spec)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choices must be a non-empty array of strings")
        return compiler.compile_grammar(choice_grammar(choices))
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def choice_grammar(choices: Rows[str]) -> str:
    """The EBNF grammar whose sentences are exactly `choices` (vLLM's `choice_as_grammar`)."""

    def literal(text: str) -> str:
        escaped = "".join(
            _EBNF_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text
        )
        return f'"{escaped}"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def mask_logits(logits: torch.Tensor, order: Rows[Sequence]) -> torch.Tensor:
    """`logits` [rows, vocab] (row i: `order[i]`'s next token) with each constrained row's disallowed tokens at
    -inf, as a copy; `logits` itself when no row is constrained. The masks are filled on the host, where the
    matchers live, and sent to the device in one copy."""
    rows = [i for i, seq in enumerate(order) if seq.grammar is not None]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(order), logits.shape[-1])
    for i in rows:
        grammar = order[i].grammar
        assert grammar is not None
        grammar.fill(bitmask, i)
    masked = logits.clone()
    # From pageable memory: staged at once, without waiting for the step's forward pass (engine/uploads.py).
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device, non_blocking=True), indices=rows)
    return masked
