"""The gateway's requests in the engine's wire format (engine/engine.proto): what the pool sends, value by value,
and the log-probabilities that come back."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from engine import engine_pb2 as pb
from gateway.api import Done, GatewayRequest, PromptLogprobs, TokenChunk, TokenLogprob, TokenLogprobs, Usage

# top_p 0 (OpenAI accepts it) is the limit of keeping only the most likely token. The engine's wire format
# reads 0 as "not set" (no cut), so the smallest mass goes instead, which keeps that token only.
SMALLEST_TOP_P = 1e-6


def generate_request(request: GatewayRequest, engine_name: str) -> pb.GenerateRequest:
    """The engine's `GenerateRequest` for `request` on adapter version `engine_name` ("" for the base model);
    raises ValueError where a value does not fit the wire (a top_k past uint32, text that is not UTF-8)."""
    s = request.sampling
    sampling = pb.SamplingParams(
        max_tokens=s.max_tokens or 0,
        temperature=s.temperature,
        top_p=max(s.top_p, SMALLEST_TOP_P),
        top_k=s.top_k,
        stop=s.stop,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias),
        min_p=s.min_p,
        min_tokens=s.min_tokens,
        ignore_eos=s.ignore_eos,
        stop_token_ids=s.stop_token_ids,
        include_stop_str_in_output=s.include_stop_str_in_output,
        structured_kind=s.structured_kind,
        structured_spec=s.structured_spec,
    )
    if s.seed is not None:
        # Clients send int64 seeds (OpenAI's range, negatives included); the wire's uint64 takes them mod 2^64,
        # so each seed still names one sequence of draws.
        sampling.seed = s.seed % 2**64
    if s.logprobs is not None:
        sampling.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        sampling.prompt_logprobs = s.prompt_logprobs
        sampling.prompt_only = s.max_tokens == 0  # the wire's max_tokens 0 is the engine default
    message = pb.GenerateRequest(
        request_id=request.request_id,
        adapter=engine_name,
        sampling=sampling,
        priority=request.priority,
        cache_salt=cache_salt(request),
    )
    if request.messages is not None:
        message.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.content) for m in request.messages)
    else:
        message.prompt = request.prompt or ""
    return message


def cache_salt(request: GatewayRequest) -> str:
    """The engine's prefix-cache salt of `request`: its tenant, and the client's own salt if any. Tenants never
    share cached prompt tokens, so none can tell from a faster first token that another sent the same prompt."""
    return json.dumps([request.tenant, request.cache_salt])


def token_logprobs(entries: Iterable[pb.TokenLogprobs]) -> tuple[TokenLogprobs, ...]:
    """The log-probabilities of a `GenerateResponse`'s tokens, as the gateway's events carry them."""
    return tuple(TokenLogprobs(_token(e.sampled), tuple(_token(t) for t in e.top)) for e in entries)


def prompt_logprobs(message: pb.PromptLogprobs) -> PromptLogprobs:
    """The log-probabilities of a prompt's tokens, as the gateway's events carry them."""
    return PromptLogprobs(_token(message.first), token_logprobs(message.rest), tuple(message.ranks))


def _token(t: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(t.token, t.token_bytes, t.logprob, t.token_id)


def absolute_path(path: str) -> str:
    """`path` made absolute against the gateway's working directory, for engines on this host."""
    # Pure string work (no filesystem access): engines on this host need absolute paths.
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


class ResponseEvents:
    """A `Generate` stream's responses as the gateway's events, in order: a `TokenChunk` for each response with
    text, then `Done`. Tokens whose text the engine holds back (a possible stop string, part of a character)
    and their log-probabilities wait for the next chunk; the prompt's log-probabilities go out once, with the
    first event; the first chunk names the adapter `version` serving the request (streams send it as a
    header)."""

    def __init__(self, version: str | None) -> None:
        self._version = version
        self._sent_text = False
        self._tokens = 0
        self._logprobs: tuple[TokenLogprobs, ...] = ()
        self._prompt: PromptLogprobs | None = None

    def of(self, response: pb.GenerateResponse) -> list[TokenChunk | Done]:
        """The events `response` completes."""
        out: list[TokenChunk | Done] = []
        self._tokens += len(response.token_ids)
        if response.logprobs:
            self._logprobs += token_logprobs(response.logprobs)
        if response.HasField("prompt_logprobs"):
            self._prompt = prompt_logprobs(response.prompt_logprobs)
        if response.text or (self._logprobs and response.finish_reason):
            version = self._version if not self._sent_text else None
            out.append(TokenChunk(response.text, self._tokens, version, self._logprobs, self._prompt))
            self._tokens, self._logprobs, self._prompt, self._sent_text = 0, (), None, True
        if response.finish_reason:
            usage = response.usage
            counts = Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
            out.append(Done(response.finish_reason, counts, self._version, self._prompt))
        return out
