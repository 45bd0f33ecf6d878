"""The OpenAPI description of vLLM's /tokenize and /detokenize (protocols/rest_tokenize.py), merged into
`protocols.openapi.openapi_document`; tests/unit/protocols/test_rest_tokenize.py holds the two together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocols.rest_input import MAX_TOKEN_ID
from protocols.rest_tokenize import CHAT_ONLY, MAX_DETOKENIZE_TOKENS

_MODEL = {"type": "string", "description": "base, base:ADAPTER or ADAPTER, as for completions"}
_CHAT_ONLY = "Only with messages: with a prompt, anything but null is a 400"
_STRS = {
    "type": ["boolean", "null"],
    "description": "Also return each token as the vocabulary spells it (default false)",
}


def tokenize_schemas(ref: Callable[[str], dict[str, str]]) -> dict[str, Any]:
    """The request and reply schemas; `ref` names another component schema."""
    prompt = _variant(
        "prompt",
        {"type": "string"},
        "messages",
        add_special_tokens="The tokenizer's special tokens around the prompt, as a completion has them (default true)",
    )
    chat = _variant(
        "messages",
        {"type": "array", "items": ref("ChatMessage"), "minItems": 1},
        "prompt",
        add_generation_prompt="Open the assistant's turn at the end, as a chat completion does (default true)",
        add_special_tokens="The tokenizer's special tokens around the rendered chat, beside those its template "
        "writes (default false, as a chat completion has it)",
    )
    token_id = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
    return {
        "TokenizeRequest": {
            "oneOf": [prompt, chat],
            "examples": [
                {"model": "base", "prompt": "The capital of France is", "return_token_strs": True},
                {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}]},
            ],
        },
        "TokenizeResponse": {
            "type": "object",
            "properties": {
                "count": {"type": "integer", "minimum": 0},
                "max_model_len": {"type": "integer", "minimum": 1},
                "tokens": {"type": "array", "items": token_id},
                "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
            },
            "required": ["count", "max_model_len", "tokens", "token_strs"],
        },
        "DetokenizeRequest": {
            "type": "object",
            "properties": {
                "model": _MODEL,
                "tokens": {
                    "type": "array",
                    "items": token_id,
                    "minItems": 1,
                    "maxItems": MAX_DETOKENIZE_TOKENS,
                    "description": "Ids past the model's vocabulary are a 400 naming tokens",
                },
            },
            "required": ["model", "tokens"],
            "examples": [{"model": "base", "tokens": [504, 3575, 282, 4649, 314]}],
        },
        "DetokenizeResponse": {
            "type": "object",
            "properties": {"prompt": {"type": "string", "description": "The tokens' text, special tokens included"}},
            "required": ["prompt"],
        },
    }


def _variant(field: str, schema: dict[str, Any], other: str, **flags: str) -> dict[str, Any]:
    """One of /tokenize's bodies: `field` holds the input, `other` (the other input) is refused, `flags` are the
    booleans it reads beside return_token_strs, with their descriptions."""
    booleans = {name: {"type": ["boolean", "null"], "description": text} for name, text in flags.items()}
    # Chat-only fields sent with a prompt would be ignored in silence: refused instead.
    chat_only = {} if field == "messages" else {name: {"type": "null", "description": _CHAT_ONLY} for name in CHAT_ONLY}
    return {
        "type": "object",
        "properties": {"model": _MODEL, field: schema, **booleans, **chat_only, "return_token_strs": _STRS},
        "required": ["model", field],
        "not": {"required": [other]},
    }


def tokenize_paths(
    ref: Callable[[str], dict[str, str]], ok: Callable[[dict[str, Any], str], dict[str, Any]], errors: dict[str, Any]
) -> dict[str, Any]:
    """The two paths; `ok(schema, description)` is a JSON reply, `errors` the error replies they may give."""

    def post(summary: str, request: str, reply: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
                "responses": {"200": ok(ref(reply), "OK"), **errors},
            }
        }

    return {
        "/tokenize": post(
            "vLLM's: a prompt or chat as the engine tokenizes it for a request", "TokenizeRequest", "TokenizeResponse"
        ),
        "/detokenize": post("vLLM's: token ids back to text", "DetokenizeRequest", "DetokenizeResponse"),
    }
