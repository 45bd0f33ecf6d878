"""The OpenAPI 3.1 description of the REST API, served at /openapi.json.

It must say what `protocols.rest_input` accepts and `protocols.rest` answers, no more and no less:
tests/unit/protocols/test_openapi.py checks the request schemas against the parser value by value, the
paths against the routes the server registers, and real replies against the response schemas.
"""

from __future__ import annotations

from typing import Any

from protocols.openapi_tokenize import tokenize_paths, tokenize_schemas
from protocols.rest_input import (
    _MAX_FLOAT32,
    _MAX_LOGIT_BIAS,
    _MAX_LOGPROBS,
    _MAX_MIN_TOKENS,
    _MAX_SEED,
    _MAX_STOP,
    _MAX_STOP_TOKEN_IDS,
    _MAX_TOP_K,
    _MIN_SEED,
    _TOKEN_ID,
    MAX_CACHE_SALT,
    MAX_CHOICES,
    MAX_TOKEN_ID,
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    return out


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or null: the parser treats an optional field sent as null like an absent one."""
    out = dict(schema)
    if "const" in out:
        out["enum"] = [out.pop("const")]
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    if out.get("type", "null") != "null":
        out["type"] = [out["type"], "null"]
    if "oneOf" in out:
        out["oneOf"] = [*out["oneOf"], {"type": "null"}]
    return out


def _request(
    properties: dict[str, Any],
    required: tuple[str, ...],
    example: dict[str, Any],
    *,
    refused: dict[str, Any] | None = None,
    more_examples: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A request body's schema; `refused` describes bodies refused whatever their fields' own values."""
    props = {name: s if name in required else _nullable(s) for name, s in properties.items()}
    out = {**_object(props, required), "examples": [example, *(more_examples or ())]}
    if refused is not None:
        out["not"] = refused
    return out


def _unsupported(schema: dict[str, Any], accepted: str) -> dict[str, Any]:
    return {**schema, "description": f"Not supported: only {accepted} is accepted (anything else is a 400)"}


_REQUEST_ID_HEADER = {
    "description": "The request's id: the client's X-Request-Id when usable, else one made up",
    "schema": {"type": "string"},
}
_RETRY_AFTER = {"description": "Seconds to wait before retrying", "schema": {"type": "integer", "minimum": 1}}

_ERROR_TEXTS = {
    400: "Malformed request (the message names the field, `param` too where there is one)",
    401: "Missing or invalid API key",
    403: "Not allowed for this tenant or by policy",
    404: "Unknown model (or adapter)",
    413: "Request body too large",
    429: "Throttled by admission limits; see Retry-After",
    500: "Internal error",
    503: "No engine available, or the gateway is draining",
    504: "Deadline passed while queued or generating",
}


def _errors(*codes: int) -> dict[str, Any]:
    out = {}
    for code in codes:
        headers = {"X-Request-Id": _REQUEST_ID_HEADER}
        if code in (429, 503):
            headers["Retry-After"] = _RETRY_AFTER
        out[str(code)] = _json(_ref("Error"), _ERROR_TEXTS[code], headers)
    return out


_ONE_CONSTRAINT = (
    "At most one structured output constraint per request (else a 400); a schema, regex or grammar that does not "
    "compile is a 400 naming its field. The reply ends (finish_reason stop) where the constraint is complete"
)

_SAMPLING: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "'base', 'base:ADAPTER' or 'ADAPTER'"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "maximum": _MAX_TOP_K, "description": "Extension: 0 or -1 = off"},
    "seed": {"type": "integer", "minimum": _MIN_SEED, "maximum": _MAX_SEED},
    "stop": {
        "description": "Empty strings are ignored",
        "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": _MAX_STOP}],
    },
    "n": {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_CHOICES,
        "description": "Choices to generate; each takes a place in the tenant's queue. With a seed, choice i is "
        "sampled as a single request with seed + i",
    },
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string", "description": "Also the routing key when X-Routing-Key is absent"},
    "cache_salt": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_CACHE_SALT,
        "description": "vLLM's prefix-cache salt: cached prompt tokens are shared only with requests of the same "
        "tenant and salt",
    },
    "frequency_penalty": {
        "type": "number",
        "minimum": -2,
        "maximum": 2,
        "description": "Subtracted from a token's logit once per time it was generated (greedy too)",
    },
    "presence_penalty": {
        "type": "number",
        "minimum": -2,
        "maximum": 2,
        "description": "Subtracted from the logit of every token generated so far (greedy too)",
    },
    "logit_bias": {
        "type": "object",
        "maxProperties": _MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": f"^({_TOKEN_ID.pattern})$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "Token id -> bias added to its logit (greedy too); an id past the vocabulary is a 400",
    },
    # vLLM's sampling extensions.
    "repetition_penalty": {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": _MAX_FLOAT32,
        "description": "Extension (vLLM): tokens of the prompt or output have their logit divided by it where "
        "positive, multiplied where negative; 1 = off",
    },
    "min_p": {
        "type": "number",
        "minimum": 0,
        "maximum": 1,
        "description": "Extension (vLLM): tokens less likely than min_p times the top token are dropped "
        "(after temperature; no effect when greedy)",
    },
    "min_tokens": {
        "type": "integer",
        "minimum": 0,
        "maximum": _MAX_MIN_TOKENS,
        "description": "Extension (vLLM): no end-of-sequence token, no stop_token_ids token and no stop string "
        "before this many tokens; at most max_tokens (a 400 otherwise)",
    },
    "ignore_eos": {
        "type": "boolean",
        "description": "Extension (vLLM): the end-of-sequence token does not end the reply, which goes on to "
        "max_tokens unless stop or stop_token_ids ends it",
    },
    "stop_token_ids": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
        "maxItems": _MAX_STOP_TOKEN_IDS,
        "description": "Extension (vLLM): sampling one of these token ids ends the reply (finish_reason stop, "
        "ignore_eos or not); the token counts in the usage and has its logprobs, its text is left out unless "
        "include_stop_str_in_output; an id past the vocabulary is a 400",
    },
    "include_stop_str_in_output": {
        "type": "boolean",
        "description": "Extension (vLLM): the stop string (or stop_token_ids token) that ends the reply stays in "
        "its text",
    },
    # Structured outputs: at most one of response_format (other than text) and the guided_* fields (rest_input).
    "response_format": {
        "oneOf": [
            _object({"type": {"enum": ["text", "json_object"]}}, ("type",)),
            _object(
                {"type": {"const": "json_schema"}, "json_schema": _ref("JsonSchemaFormat")}, ("type", "json_schema")
            ),
        ],
        "description": "OpenAI's: text (no constraint), json_object (the reply is a JSON object) or json_schema (the "
        "reply follows the schema). " + _ONE_CONSTRAINT,
    },
    "guided_json": {
        "oneOf": [{"type": "object"}, {"type": "string", "pattern": "^\\s*\\{"}],
        "description": "Extension (vLLM): the reply follows this JSON schema (an object, or a string holding one). "
        + _ONE_CONSTRAINT,
    },
    "guided_regex": {
        "type": "string",
        "minLength": 1,
        "description": "Extension (vLLM): the reply matches this regular expression. " + _ONE_CONSTRAINT,
    },
    "guided_choice": {
        "type": "array",
        "items": {"type": "string", "minLength": 1},
        "minItems": 1,
        "description": "Extension (vLLM): the reply is exactly one of these strings. " + _ONE_CONSTRAINT,
    },
    "guided_grammar": {
        "type": "string",
        "minLength": 1,
        "description": "Extension (vLLM): the reply follows this EBNF grammar (xgrammar's, with a root rule). "
        + _ONE_CONSTRAINT,
    },
    # vLLM's sampling extensions the engine has no knob for (rest_input._VLLM_NO_OPS).
    "use_beam_search": _unsupported({"type": "boolean", "const": False}, "false"),
    "guided_whitespace_pattern": _unsupported({"type": "null"}, "null"),
    "structured_outputs": _unsupported({"type": "null"}, "null (send the guided_* fields)"),
    "prompt_logprobs": {
        "type": "integer",
        "minimum": 0,
        "maximum": _MAX_LOGPROBS,
        "description": "Extension (vLLM): each prompt token's logprob given the tokens before it (the first has none), "
        "its rank and this many most likely tokens at its position, in the reply's prompt_logprobs; the prompt skips "
        "the prefix cache. Above 0 refused with stream",
    },
}
# vLLM's: prompt_logprobs above 0 do not stream (a 400).
_STREAMED_PROMPT_LOGPROBS = {
    "required": ["prompt_logprobs", "stream"],
    "properties": {"prompt_logprobs": {"type": "integer", "minimum": 1}, "stream": {"const": True}},
}
_LOGPROBS_NOTE = (
    "Log-probabilities of the model's raw distribution (before penalties, logit_bias, temperature, min_p, top_k "
    "and top_p); above "
    f"{_MAX_LOGPROBS} a 400"
)

_HEADERS = [
    {
        "name": "X-Request-Id",
        "in": "header",
        "schema": {"type": "string", "pattern": "^[!-~]{1,128}$"},
        "description": "Echoed back, and in every SSE chunk's id; a value that does not match is replaced "
        "by a made-up id, not refused",
    },
    {
        "name": "X-Routing-Key",
        "in": "header",
        "schema": {"type": "string"},
        "description": "Sticky choice among an adapter's versions",
    },
    {
        "name": "X-Request-Timeout",
        "in": "header",
        "schema": {"type": "number", "exclusiveMinimum": 0},
        "description": "Seconds; may only shorten the configured deadline",
    },
]

_PUBLIC: list[dict[str, list[str]]] = []  # security: none


def _schemas() -> dict[str, Any]:
    usage = _object({k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")})
    usage["required"] = list(usage["properties"])
    usage["properties"]["prompt_tokens_details"] = _object(
        {"cached_tokens": {"type": "integer", "description": "Prompt tokens read from the engine's prefix cache"}},
        ("cached_tokens",),
    )
    finish = {"type": "string", "enum": ["stop", "length"]}
    text_part = _object({"type": {"const": "text"}, "text": {"type": "string"}}, ("type", "text"))
    message = _object(
        {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
        },
        ("role", "content"),
    )
    head = ("id", "object", "created", "model", "choices")

    def reply(kind: str, choice: dict[str, Any], *, chunk: bool) -> dict[str, Any]:
        properties = {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": {"type": "string", "description": "The request's model, as written"},
            "choices": {"type": "array", "items": choice, "maxItems": 1 if chunk else MAX_CHOICES},
            "usage": _ref("Usage"),
        }
        if chunk:
            properties["usage"] = {
                **_ref("Usage"),
                "description": "With stream_options.include_usage, in a last chunk whose choices is []",
            }
            return _object(properties, head)
        return _object(properties, (*head, "usage"))

    def with_prompt_logprobs(schema: dict[str, Any]) -> dict[str, Any]:
        schema["properties"]["prompt_logprobs"] = prompt_logprobs  # set where the request asked (vLLM's place)
        return schema

    # Null unless the request asked for log-probabilities; a stream's chunks carry those of their own tokens.
    chat_logprobs = {"oneOf": [{"type": "null"}, _ref("ChatLogprobs")]}
    text_logprobs = {"oneOf": [{"type": "null"}, _ref("CompletionLogprobs")]}
    # A choice's place among the request's `n`; a stream's chunks of different choices interleave.
    index = {"type": "integer", "minimum": 0, "maximum": MAX_CHOICES - 1}
    chat_choice = {
        "index": index,
        "message": _object({"role": {"const": "assistant"}, "content": {"type": "string"}}, ("role", "content")),
        "logprobs": chat_logprobs,
        "finish_reason": finish,
    }
    chunk_choice = {
        "index": index,
        "delta": _object({"role": {"const": "assistant"}, "content": {"type": "string"}}),
        "logprobs": chat_logprobs,
        "finish_reason": _nullable(finish),
    }
    text_choice = {"index": index, "text": {"type": "string"}, "logprobs": text_logprobs}
    # vLLM's prompt_logprobs, where the request asked: one per prompt token, the first null.
    prompt_logprobs = {
        "type": "array",
        "items": {"oneOf": [{"type": "null"}, {"type": "object", "additionalProperties": _ref("PromptLogprob")}]},
        "description": "Per prompt token: null for the first; else token id -> its logprob, rank and text, the prompt "
        "token first, then the prompt_logprobs most likely tokens",
    }
    prompt_logprob = _object(
        {
            "logprob": {"type": "number", "description": "-9999.0 for a token the model rules out"},
            "rank": {"type": "integer", "minimum": 1, "description": "1: the most likely token"},
            "decoded_token": {"type": "string"},
        },
        ("logprob", "rank", "decoded_token"),
    )
    token = {
        "token": {"type": "string", "description": "The token decoded alone (part of a character reads U+FFFD)"},
        "logprob": {"type": "number", "description": "-9999.0 for a token the model rules out"},
        "bytes": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 255},
            "description": "The token's bytes: a completion's add up to its UTF-8 text",
        },
    }
    top_tokens = {"type": "array", "items": _object(token, tuple(token)), "maxItems": _MAX_LOGPROBS}
    chat_entry = _object({**token, "top_logprobs": top_tokens}, (*token, "top_logprobs"))
    text_logprobs_object = _object(
        {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {
                "type": "array",
                "items": {"type": ["number", "null"]},
                "description": "null for an echoed prompt's first token",
            },
            "top_logprobs": {
                "type": "array",
                "items": {"oneOf": [{"type": "null"}, {"type": "object", "maxProperties": _MAX_LOGPROBS + 1}]},
                "description": "Per token: the `logprobs` most likely tokens and the sampled one, token -> logprob "
                "(null for an echoed prompt's first token)",
            },
            "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
        ("tokens", "token_logprobs", "top_logprobs", "text_offset"),
    )
    return {
        "Error": _object(
            {
                "error": _object(
                    {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "null"]},
                    },
                    ("message", "type", "param", "code"),
                )
            },
            ("error",),
        ),
        "Usage": usage,
        "ChatLogprobs": _object({"content": {"type": "array", "items": chat_entry}}, ("content",)),
        "CompletionLogprobs": text_logprobs_object,
        "PromptLogprob": prompt_logprob,
        "ChatMessage": message,
        "JsonSchemaFormat": _object(
            {
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                "schema": {"type": "object", "description": "The JSON schema the reply follows"},
                "strict": {"type": ["boolean", "null"], "description": "Accepted; the schema is always enforced"},
                "description": {"type": ["string", "null"]},
            },
            ("name", "schema"),
        ),
        "ChatCompletionRequest": _request(
            {
                **_SAMPLING,
                "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
                "max_completion_tokens": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Takes precedence over max_tokens",
                },
                "tools": _unsupported({"type": "array", "maxItems": 0}, "[]"),
                "functions": _unsupported({"type": "array", "maxItems": 0}, "[]"),
                "tool_choice": _unsupported({"type": "string", "const": "none"}, '"none"'),
                # vLLM's chat echo (the last message repeated when the reply has its role) is not completions' echo.
                "echo": _unsupported({"type": "boolean", "const": False}, "false"),
                "logprobs": {"type": "boolean", "description": _LOGPROBS_NOTE},
                "top_logprobs": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": _MAX_LOGPROBS,
                    "description": "The most likely tokens to list at each position; above 0 it needs logprobs true",
                },
            },
            ("model", "messages"),
            {"model": "pirate", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
            # top_logprobs above 0 without logprobs true is a 400 (OpenAI's rule; 0 alone changes nothing, as in vLLM).
            refused={
                "anyOf": [
                    {
                        "required": ["top_logprobs"],
                        "properties": {
                            "top_logprobs": {"type": "integer", "minimum": 1},
                            "logprobs": {"not": {"const": True}},
                        },
                    },
                    _STREAMED_PROMPT_LOGPROBS,
                ]
            },
            more_examples=[
                {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 3},
                {
                    "model": "base",
                    "messages": [{"role": "user", "content": "Describe Ann, 31, as JSON."}],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "person",
                            "schema": {
                                "type": "object",
                                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                                "required": ["name", "age"],
                            },
                        },
                    },
                },
            ],
        ),
        "CompletionRequest": _request(
            {
                **_SAMPLING,
                "prompt": {
                    "oneOf": [
                        {"type": "string"},
                        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                    ],
                    "description": "One text prompt (a list of exactly one string is accepted)",
                },
                "logprobs": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": _MAX_LOGPROBS,
                    "description": f"The sampled token's logprob and this many most likely tokens'. {_LOGPROBS_NOTE}",
                },
                "max_tokens": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "0 only with echo: no token is generated, the reply is the prompt (with logprobs, "
                    "its tokens' logprobs: a text's score)",
                },
                "echo": {
                    "type": "boolean",
                    "description": "The prompt's text comes first in each choice's text (the first chunk of a stream) "
                    "and, with logprobs, its tokens' entries before the completion's, the first with null logprob "
                    "and top_logprobs",
                },
                "suffix": _unsupported({"type": "string", "maxLength": 0}, '""'),
                "best_of": _unsupported({"type": "integer", "enum": [1]}, "1 (use n for several choices)"),
            },
            ("model", "prompt"),
            {"model": "base", "prompt": "Once upon a time", "max_tokens": 16},
            refused={
                "anyOf": [
                    {
                        "required": ["max_tokens"],
                        "properties": {"max_tokens": {"const": 0}, "echo": {"not": {"const": True}}},
                    },
                    _STREAMED_PROMPT_LOGPROBS,
                ]
            },
            more_examples=[
                {
                    "model": "base",
                    "prompt": "The capital of France is Paris.",
                    "max_tokens": 0,
                    "echo": True,
                    "logprobs": 1,
                },
                {"model": "base", "prompt": "The capital of France is Paris.", "max_tokens": 1, "prompt_logprobs": 2},
                {
                    "model": "base",
                    "prompt": "Once upon a time",
                    "max_tokens": 32,
                    "frequency_penalty": 1.0,
                    "repetition_penalty": 1.1,
                    "min_tokens": 8,
                    "logit_bias": {"2": -100},
                },
                {
                    "model": "base",
                    "prompt": "Q: What is the capital of France?\nA:",
                    "max_tokens": 32,
                    "stop": ["."],
                    "include_stop_str_in_output": True,
                    "stop_token_ids": [2],
                },
                {"model": "base", "prompt": "Is the sky blue? Answer:", "guided_choice": ["yes", "no"]},
            ],
        ),
        "ChatCompletion": with_prompt_logprobs(
            reply("chat.completion", _object(chat_choice, tuple(chat_choice)), chunk=False)
        ),
        "ChatCompletionChunk": reply("chat.completion.chunk", _object(chunk_choice, tuple(chunk_choice)), chunk=True),
        "Completion": reply(
            "text_completion",
            with_prompt_logprobs(_object({**text_choice, "finish_reason": finish}, (*text_choice, "finish_reason"))),
            chunk=False,
        ),
        "CompletionChunk": reply(
            "text_completion",
            _object({**text_choice, "finish_reason": _nullable(finish)}, (*text_choice, "finish_reason")),
            chunk=True,
        ),
        "Model": _object(
            {
                "id": {"type": "string"},
                "object": {"const": "model"},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
                "root": {"type": "string", "description": "The base model"},
            },
            ("id", "object", "created", "owned_by"),
        ),
        "ModelList": _object(
            {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}, ("object", "data")
        ),
        "Health": _object(
            {"status": {"type": "string", "enum": ["ok", "unavailable"]}, "detail": {"type": "string"}},
            ("status", "detail"),
        ),
    }


def _generate(summary: str, request: str, reply: str, chunk: str) -> dict[str, Any]:
    sse = {
        "schema": {
            "type": "string",
            "description": f"`data: {{{chunk}}}` events, then `data: [DONE]`; an error after the stream "
            "started arrives as one `data: {Error}` event before `data: [DONE]`",
        }
    }
    return {
        "post": {
            "summary": summary,
            "parameters": _HEADERS,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {
                "200": {
                    "description": "JSON reply, or SSE chunks when stream is true",
                    "headers": {
                        "X-Request-Id": _REQUEST_ID_HEADER,
                        "X-Adapter-Version": {
                            "description": "The adapter version that answered (adapter requests, streamed or not)",
                            "schema": {"type": "string"},
                        },
                    },
                    "content": {"application/json": {"schema": _ref(reply)}, "text/event-stream": sse},
                },
                **_errors(400, 401, 403, 404, 413, 429, 500, 503, 504),
            },
        }
    }


def _admin(summary: str, ok: dict[str, Any], *errors: int, **extra: Any) -> dict[str, Any]:
    return {
        "summary": summary,
        "tags": ["admin"],
        "security": [{"admin": []}],
        "responses": {"200": _json(ok, "OK"), **_errors(401, 403, 500, 503, *errors)},
        **extra,
    }


def openapi_document(model_name: str) -> dict[str, Any]:
    """The API description; `model_name` is the base model behind "base"."""
    adapter_name = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
    manifests = _object({"manifests": {"type": "array", "items": {"type": "object"}, "minItems": 1}}, ("manifests",))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "adaptergate",
            "version": "0.1.0",
            "description": f"OpenAI-compatible API over {model_name} and its LoRA adapters.",
        },
        "components": {
            "schemas": {**_schemas(), **tokenize_schemas(_ref)},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "A tenant's API key"},
                "admin": {"type": "http", "scheme": "bearer", "description": "An admin API key"},
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": _generate(
                "Chat completion", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
            ),
            "/v1/completions": _generate("Text completion", "CompletionRequest", "Completion", "CompletionChunk"),
            **tokenize_paths(_ref, _json, _errors(400, 401, 403, 404, 413, 500, 503)),
            "/v1/models": {
                "get": {
                    "summary": "Models this tenant may use: base and its adapters",
                    "responses": {"200": _json(_ref("ModelList"), "Model list"), **_errors(401, 500, 503)},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One model of /v1/models",
                    "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {"200": _json(_ref("Model"), "The model"), **_errors(401, 404, 500, 503)},
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "security": _PUBLIC,
                    "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1 document")},
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Readiness",
                    "security": _PUBLIC,
                    "responses": {
                        "200": _json(_ref("Health"), "ready"),
                        "503": _json(_ref("Health"), "not ready, or draining"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "security": _PUBLIC,
                    "responses": {"200": {"description": "Prometheus text exposition"}},
                }
            },
            "/admin/adapters": {
                "post": _admin(
                    "Create or update AdapterInstance manifests",
                    _object({"applied": {"type": "array", "items": {"type": "object"}}}, ("applied",)),
                    400,
                    413,
                    requestBody={
                        "required": True,
                        "content": {
                            "application/json": {"schema": manifests},
                            "application/yaml": {"schema": {"type": "string", "description": "YAML manifests"}},
                        },
                    },
                ),
                "get": _admin(
                    "Every adapter, with its residency on the engines",
                    _object({"adapters": {"type": "array", "items": {"type": "object"}}}, ("adapters",)),
                ),
            },
            "/admin/adapters/{name}": {
                "get": _admin("One adapter, with its residency", {"type": "object"}, 404, parameters=adapter_name),
                "delete": _admin(
                    "Delete an adapter",
                    _object({"deleted": {"type": "string"}}, ("deleted",)),
                    404,
                    parameters=adapter_name,
                ),
            },
            "/admin/queues": {
                "get": _admin(
                    "Per-tenant queue state",
                    _object({"tenants": {"type": "object"}, "total_depth": {"type": "integer"}}, ("tenants",)),
                )
            },
            "/admin/engines": {
                "get": _admin(
                    "Engine replicas and their adapters", _object({"engines": {"type": "object"}}, ("engines",))
                )
            },
        },
    }
