"""What a sampled token does to its request: the text it adds to the stream, or how the request ends.

The engine thread calls these for every token it reads; they decide, by vLLM's rules, between an end token, a
stop token, a stop string, the length limits, and a plain output (whose text is held back while it could still
be the start of a stop string).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.logprobs import TokenLogprobs
from engine.sequence import RequestOutput, Sequence


@dataclass(frozen=True, slots=True)
class Ending:
    """How a token ends its request: `reason` ("stop", "length"), the text cut at `text_end` (None: all of
    it), and whether the token is an output token of the request (`counted`)."""

    reason: str
    text_end: int | None = None
    counted: bool = True
    error: str | None = None  # with reason "error"


def take_token(
    seq: Sequence, token: int, logprobs: TokenLogprobs | None, eos_ids: frozenset[int] | set[int], max_model_len: int
) -> RequestOutput | Ending:
    """Add `token` to `seq`'s output: the output to send its sink, or how it ends."""
    params = seq.params
    grammar = seq.grammar
    if grammar is not None:
        # The mask allowed only tokens the grammar accepts; a refused one means logits with no allowed finite
        # value (NaN), and the reply could no longer follow its grammar.
        if not grammar.accept(token):
            return Ending("error", counted=False, error=f"token {token} does not follow the structured output")
        # The end token of a complete grammar: nothing may follow it, ignore_eos or not.
        if grammar.terminated:
            return Ending("stop", counted=False)
    if token in eos_ids and not params.ignore_eos:
        return Ending("stop", counted=False)
    seq.output_ids.append(token)
    if token in params.stop_token_ids:
        # vLLM's: a stop token is an output token (counted, with its log-probabilities) whose text is left out
        # unless asked for; a stop string it would complete does not matter, it ends the request anyway.
        if params.include_stop_str_in_output:
            seq.decoder.push(token)
        return Ending("stop")
    added = seq.decoder.push(token)
    text = seq.decoder.text
    # A stop string counts where it ends in this token's text: one that ended earlier was found then, or fell
    # within min_tokens, which holds stop strings off as it holds end tokens (vLLM's rule).
    if params.stop and len(seq.output_ids) > params.min_tokens:
        end = seq.stop_string_end(len(text) - len(added))
        if end is not None:
            return Ending("stop", text_end=end)
    if len(seq.output_ids) >= params.max_tokens or seq.context_len >= max_model_len:
        return Ending("length")
    # Hold back a possible stop-string prefix until it is ruled out.
    safe_end = len(text) - seq.held_back
    delta = text[seq.emitted_chars : safe_end] if safe_end > seq.emitted_chars else ""
    seq.emitted_chars += len(delta)
    entries = () if logprobs is None else (logprobs,)
    prompt_len, output_len = len(seq.prompt_ids), len(seq.output_ids)
    return RequestOutput(seq.request_id, delta, (token,), None, prompt_len, output_len, logprobs=entries)


def final_output(
    seq: Sequence,
    reason: str,
    text_end: int | None,
    new_token: int | None,
    logprobs: TokenLogprobs | None,
    error: str | None,
) -> RequestOutput:
    """The last output of `seq`, ended for `reason`: the text not sent yet (up to `text_end`), and the token
    that ended it when that one counts."""
    text = seq.decoder.text if text_end is None else seq.decoder.text[:text_end]
    delta = text[seq.emitted_chars :] if reason != "error" else ""
    return RequestOutput(
        seq.request_id,
        delta,
        () if new_token is None else (new_token,),
        reason,
        len(seq.prompt_ids),
        len(seq.output_ids),
        error=error,
        logprobs=() if logprobs is None else (logprobs,),
        cached_tokens=seq.cached_tokens,
    )
