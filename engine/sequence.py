"""A request inside the engine: its tokens, sampling state, adapter and output bookkeeping."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.logprobs import PromptLogprob, TokenLogprobs
from engine.pool import AdapterVersion
from engine.sampling import SamplingParams
from engine.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from engine.structured import Grammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What a request produced in one step; the last one has `finish_reason` set."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of prefilled
    # One per entry of `token_ids` when the request asked for log-probabilities, else empty.
    logprobs: tuple[TokenLogprobs, ...] = ()
    # With prompt_logprobs, on the request's first output only: one per prompt token from the second on.
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None


OutputSink = Callable[[RequestOutput], None]


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterVersion | None
    sink: OutputSink
    decoder: IncrementalDecoder
    generator: torch.Generator | None
    priority: int = 0
    cache_salt: str = ""  # prompts share prefix-cached tokens only under the same salt
    grammar: Grammar | None = None  # a structured output's matcher (engine/structured.py), advanced per token
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    kv_slot: int = -1
    lora_slot: int = -1
    prefilled: int = 0  # prompt tokens in the KV cache (a long prompt is prefilled in chunks)
    cached_tokens: int = 0  # of those, read from the prefix cache (`engine/prefix_cache.py`)
    output_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    aborted: bool = False
    # With prompt_logprobs: those of the prompt chunks prefilled so far; None once sent with the first output.
    prompt_logprobs: list[PromptLogprob] | None = field(default_factory=list)

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_done(self) -> bool:
        """Whether the whole prompt is in the KV cache: the sequence decodes from here on."""
        return self.prefilled == len(self.prompt_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the request asked for prompt log-probabilities: every prompt position is prefilled for it
        (no prefix-cache hit, no prefill graph, which yields the last position's logits only)."""
        return self.params.prompt_logprobs is not None

    @property
    def held_back(self) -> int:
        """How many characters at the end of the text wait, as they may begin a stop string left out of the
        output. A stop string kept in the output holds nothing back: the text is cut at its end, past what was
        sent (vLLM's stop buffer)."""
        p = self.params
        if not p.stop or p.include_stop_str_in_output:
            return 0
        return max(len(s) for s in p.stop) - 1

    def stop_string_end(self, before: int) -> int | None:
        """Where the text ends if a stop string ends in it past `before` (its length before the newest token): at
        the start of the first one, or with include_stop_str_in_output at the end of the first to end; None if
        none does."""
        text, p = self.decoder.text, self.params
        hits = [(i, i + len(s)) for s in p.stop if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not hits:
            return None
        return min(end for _, end in hits) if p.include_stop_str_in_output else min(i for i, _ in hits)
