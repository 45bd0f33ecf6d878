"""vLLM's POST /tokenize and POST /detokenize: bodies validated here, the engine's tokenizer behind `TokenService`.

/tokenize takes `model` and either `prompt` (with `add_special_tokens`, default true: as a completion's prompt is
tokenized) or chat `messages` (with `add_generation_prompt`, default true, and `add_special_tokens`, default
false: as a chat completion's prompt is), and answers {count, max_model_len, tokens, token_strs}. /detokenize
takes `model` and `tokens` and answers {prompt}. The model goes through the same tenant, policy and registry
checks as a completion's.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.api import DetokenizeRequest, TokenizeRequest, TokenService
from gateway.errors import GatewayError, Status
from protocols.rest_input import (
    MAX_TOKEN_ID,
    body_object,
    chat_messages,
    field_error,
    flag,
    model_field,
    valid_text,
)
from protocols.rest_replies import error_response

# Token ids one /detokenize may carry: vLLM sets no bound; this one is past any context the engine serves and
# keeps a body within the default 1 MiB limit well apart from it (an id is up to 10 bytes of JSON).
MAX_DETOKENIZE_TOKENS = 131_072
# Fields only one input kind reads: sent with the other, they would be silently ignored.
CHAT_ONLY = ("add_generation_prompt",)


def parse_tokenize(data: object, base_name: str, tenant: str = "") -> TokenizeRequest:
    """Validate a /tokenize body."""
    body = body_object(data)
    _, adapter = model_field(body, base_name)
    prompt, raw_messages = body.get("prompt"), body.get("messages")
    if prompt is not None and raw_messages is not None:
        raise field_error("send prompt or messages, not both", "messages")
    if prompt is None and raw_messages is None:
        raise field_error("prompt (a string) or messages (a chat) is required", "prompt")
    strs = flag(body, "return_token_strs")
    if raw_messages is not None:
        messages = chat_messages(body)
        generation = flag(body, "add_generation_prompt", default=True)
        special = flag(body, "add_special_tokens")
        return TokenizeRequest(tenant, adapter, None, messages, special, generation, strs)
    if not isinstance(prompt, str):
        raise field_error("prompt must be a string", "prompt")
    for name in CHAT_ONLY:
        if body.get(name) is not None:
            raise field_error(f"{name} applies to messages, not to a prompt", name)
    special = flag(body, "add_special_tokens", default=True)
    return TokenizeRequest(tenant, adapter, valid_text(prompt, "prompt"), None, special, True, strs)


def parse_detokenize(data: object, base_name: str, tenant: str = "") -> DetokenizeRequest:
    """Validate a /detokenize body; ids past the vocabulary are the engine's to refuse (it knows the vocabulary)."""
    body = body_object(data)
    _, adapter = model_field(body, base_name)
    tokens = body.get("tokens")
    if (
        not isinstance(tokens, list)
        or not 0 < len(tokens) <= MAX_DETOKENIZE_TOKENS
        or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens)
    ):
        raise field_error(
            f"tokens must be a non-empty array of at most {MAX_DETOKENIZE_TOKENS} token ids "
            f"(integers from 0 to {MAX_TOKEN_ID})",
            "tokens",
        )
    return DetokenizeRequest(tenant, adapter, tuple(tokens))


async def tokenize_reply(service: TokenService, request: TokenizeRequest, request_id: str | None) -> web.Response:
    """The /tokenize reply for a validated `request`; `request_id` is echoed on an error."""
    try:
        tokens = await service.tokenize(request)
    except GatewayError as e:
        return _error(e, "messages" if request.messages is not None else "prompt", request_id)
    reply: dict[str, Any] = {
        "count": len(tokens.ids),
        "max_model_len": tokens.max_model_len,
        "tokens": list(tokens.ids),
        "token_strs": list(tokens.strs) if tokens.strs is not None else None,
    }
    return web.json_response(reply)


async def detokenize_reply(service: TokenService, request: DetokenizeRequest, request_id: str | None) -> web.Response:
    """The /detokenize reply for a validated `request`; `request_id` is echoed on an error."""
    try:
        text = await service.detokenize(request)
    except GatewayError as e:
        return _error(e, "tokens", request_id)
    return web.json_response({"prompt": text})


def _error(error: GatewayError, param: str, request_id: str | None) -> web.Response:
    """The reply for `error`, naming what it is about as a completion's does: the engine's refusal names the
    input, an unknown model `model` (with OpenAI's code for it)."""
    named: str | None = param if error.status is Status.INVALID_ARGUMENT else None
    code = None
    if error.status is Status.NOT_FOUND:
        named, code = "model", "model_not_found"
    return error_response(
        error.status, error.message, param=named, code=code, retry_after_s=error.retry_after_s, request_id=request_id
    )
