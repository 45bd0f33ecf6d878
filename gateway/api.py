"""The shapes every part of the gateway shares: one request, three events, a few small interfaces.

Protocols import only this module and `gateway.errors`. Everything here is frozen so a request can be
passed between tasks without anyone mutating it behind another's back.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gateway.errors import Status


class Origin(enum.Enum):
    """Wire protocol a request came in through."""

    REST = "rest"
    GRPC = "grpc"
    WEBSOCKET = "websocket"
    MQTT = "mqtt"
    KAFKA = "kafka"
    EXTPROC = "extproc"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling knobs; `max_tokens=None` means the engine default, 0 (with `prompt_logprobs` only) no token: the
    prompt's log-probabilities alone."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # None: no log-probabilities; N: each token's, with the N most likely tokens at its position beside it.
    logprobs: int | None = None
    # Logit processing (engine/logits_processing.py): OpenAI's penalties, vLLM's repetition penalty (1 = off),
    # (token id, bias) pairs, vLLM's min_p and min_tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    # vLLM's: end tokens that do not end the reply, token ids that do (their text left out), and stop strings
    # (and stop tokens' text) kept in the reply.
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    # A structured output (OpenAI's response_format, vLLM's guided_*): "json_object", "json_schema", "regex",
    # "choice" or "grammar" ("" for none), and its spec (a schema or choices as JSON text, a regex, a grammar).
    structured_kind: str = ""
    structured_spec: str = ""
    # vLLM's: None, no prompt log-probabilities; N, each prompt token's (from the second on) with the N most
    # likely tokens at its position beside it (the prompt skips the engine's prefix cache).
    prompt_logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """One inference request, whatever protocol it arrived on.

    `adapter` is the name the client asked for (None = base model); the registry resolves it to a
    concrete adapter version. Exactly one of `prompt` / `messages` is set. `deadline` is an absolute
    `time.monotonic()` value or None.
    """

    request_id: str
    tenant: str
    adapter: str | None
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    deadline: float | None = None
    priority: int = 0
    protocol: Origin = Origin.REST
    routing_key: str | None = None
    # The client's prefix-cache salt (vLLM's cache_salt): its prompts share cached tokens only with requests of
    # the same tenant and salt.
    cache_salt: str | None = None
    trace_context: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the engine read from its prefix cache instead of prefilling

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token and its log-probability under the model's raw distribution: its text decoded alone (a piece of a
    multi-byte character reads U+FFFD) and its bytes (those of a completion's tokens add up to its text)."""

    token: str
    token_bytes: bytes
    logprob: float
    token_id: int = -1  # vLLM's prompt_logprobs name tokens by id


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability, and the most likely tokens at its position, most likely first."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The log-probabilities of a prompt's tokens: the first has none (nothing comes before it); each of the
    others (`rest`, `sampled` the prompt token) has its own, its rank (`ranks`, 1: the most likely) and the most
    likely tokens at its position."""

    first: TokenLogprob  # its logprob means nothing
    rest: tuple[TokenLogprobs, ...] = ()
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """New text for the request (one or more tokens)."""

    text: str
    token_count: int = 1
    # On a request's first chunk: the adapter version serving it (None for the base model), so that a stream
    # can name it before `Done` does.
    adapter_version: str | None = None
    # With `SamplingParams.logprobs`: one per token of the chunk (the text may be empty: the chunk before `Done`
    # carries the log-probabilities of tokens whose text never came, such as one that completed a stop string).
    logprobs: tuple[TokenLogprobs, ...] = ()
    # With `SamplingParams.prompt_logprobs`: on the request's first event (this chunk, or `Done` if none came).
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """The request finished; `finish_reason` is "stop", "length" or "abort"."""

    finish_reason: str
    usage: Usage
    adapter_version: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # as `TokenChunk`'s, where no chunk came before


@dataclass(frozen=True, slots=True)
class Error:
    """The request failed; nothing else follows."""

    status: Status
    message: str
    retry_after_s: float | None = None


Event = TokenChunk | Done | Error


class Submitter(Protocol):
    """What a protocol needs from the gateway core."""

    def submit(self, request: GatewayRequest) -> AsyncIterator[Event]:
        """Admit `request` and stream its events; the stream always ends with `Done` or `Error`.

        Closing the iterator early (client gone) cancels the request wherever it is.
        """
        ...

    def authenticate(self, api_key: str | None) -> str:
        """Return the tenant owning `api_key`, or raise `Unauthenticated`."""
        ...

    def models_for(self, tenant: str) -> list[str]:
        """Model ids (`base` and adapter names) this tenant may use."""
        ...

    def refused(self, tenant: str | None, status: Status, origin: Origin) -> None:
        """Count a request the protocol refused before submitting it (authentication, bad input, draining);
        `tenant` None when it was not authenticated. What `submit` sees, it counts itself."""
        ...


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """Text to tokenize as the engine would for a request on `adapter` (vLLM's /tokenize): exactly one of `prompt`
    and `messages`. `add_special_tokens`: the tokenizer's own around the input (a prompt's request gets them, a
    chat's does not: its template writes them); `add_generation_prompt` (chat): the assistant's turn opened."""

    tenant: str
    adapter: str | None
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    protocol: Origin = Origin.REST


@dataclass(frozen=True, slots=True)
class DetokenizeRequest:
    """Token ids to turn back into text as the engine's tokenizer reads them (vLLM's /detokenize)."""

    tenant: str
    adapter: str | None
    ids: tuple[int, ...]
    protocol: Origin = Origin.REST


@dataclass(frozen=True, slots=True)
class Tokens:
    """Token ids, with each token as the vocabulary spells it where asked for, and the engine's context length."""

    ids: tuple[int, ...]
    max_model_len: int
    strs: tuple[str, ...] | None = None


class TokenService(Protocol):
    """The engine's tokenizer, behind the same tenant, policy and model checks as a completion."""

    async def tokenize(self, request: TokenizeRequest) -> Tokens:
        """Tokenize as the engine does; raises `GatewayError` (an unknown model's is NOT_FOUND)."""
        ...

    async def detokenize(self, request: DetokenizeRequest) -> str:
        """The text of `request.ids`, special tokens included; raises `GatewayError` (INVALID_ARGUMENT for an id past
        the vocabulary)."""
        ...


class ProtocolServer(Protocol):
    """One wire protocol bridged into the gateway; an async context manager that serves while open."""

    async def __aenter__(self) -> ProtocolServer:
        """Start listening."""
        ...

    async def __aexit__(self, *exc_info: object) -> None:
        """Stop accepting new requests and let in-flight ones finish."""
        ...


@dataclass(frozen=True, slots=True)
class PolicyInput:
    tenant: str
    adapter: str | None
    protocol: Origin
    max_tokens: int | None
    prompt_chars: int


@dataclass(frozen=True, slots=True)
class PolicyDecision:
    allow: bool
    reason: str = ""


class PolicyChecker(Protocol):
    """Decides whether a request may proceed; implementations live in `policy/`."""

    async def check(self, item: PolicyInput) -> PolicyDecision:
        """Return allow/deny with a reason a client can read."""
        ...


class HealthSource(Protocol):
    """Readiness of whatever serves the requests (engines), for health endpoints."""

    def health(self) -> tuple[bool, str]:
        """Return (ready, a short human-readable detail)."""
        ...
