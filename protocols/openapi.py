"""The OpenAPI 3.1 description of the REST API, served at /openapi.json."""

from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    str(code): _json(_ref("Error"), text)
    for code, text in (
        (400, "Malformed request (the message names the field)"),
        (401, "Missing or invalid API key"),
        (403, "Not allowed for this tenant or by policy"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "Throttled by admission limits; see Retry-After"),
        (503, "No engine available, or the gateway is draining"),
        (504, "Deadline passed while queued or generating"),
    )
}

_SAMPLING = {
    "model": {"type": "string", "description": "'base', 'base:ADAPTER' or 'ADAPTER'"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "description": "Extension: 0 = off"},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "n": {"type": "integer", "enum": [1]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string", "description": "Also the routing key when X-Routing-Key is absent"},
}

_HEADERS = [
    {"name": "X-Request-Id", "in": "header", "schema": {"type": "string", "maxLength": 128}},
    {
        "name": "X-Routing-Key",
        "in": "header",
        "schema": {"type": "string"},
        "description": "Sticky choice among an adapter's versions",
    },
    {
        "name": "X-Request-Timeout",
        "in": "header",
        "schema": {"type": "number"},
        "description": "Seconds; may only shorten the configured deadline",
    },
]

_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "data: {chunk} ... data: [DONE]"}}}


def openapi_document(model_name: str) -> dict[str, Any]:
    """The API description; `model_name` is the base model behind "base"."""
    usage = {
        "type": "object",
        "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        },
    }
    schemas: dict[str, Any] = {
        "Error": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "null"]},
                    },
                }
            },
        },
        "Usage": usage,
        "ChatMessage": message,
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                **_SAMPLING,
                "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
                "max_completion_tokens": {"type": "integer", "minimum": 1},
            },
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {**_SAMPLING, "prompt": {"type": "string"}},
        },
        "ChatCompletion": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "chat.completion"},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": {"type": "object"}},
                "usage": _ref("Usage"),
            },
        },
        "Completion": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "text_completion"},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": {"type": "object"}},
                "usage": _ref("Usage"),
            },
        },
        "Model": {
            "type": "object",
            "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "owned_by": {"type": "string"}},
        },
    }

    def generate(summary: str, request: str, reply: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "parameters": _HEADERS,
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
                "responses": {
                    "200": {
                        "description": "JSON reply, or SSE chunks when stream is true",
                        "content": {"application/json": {"schema": _ref(reply)}, **_SSE},
                    },
                    **_ERRORS,
                },
            }
        }

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "adaptergate",
            "version": "0.1.0",
            "description": f"OpenAI-compatible API over {model_name} and its LoRA adapters.",
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": generate("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/completions": generate("Text completion", "CompletionRequest", "Completion"),
            "/v1/models": {
                "get": {
                    "summary": "Models this tenant may use: base and its adapters",
                    "responses": {
                        "200": _json(
                            {"type": "object", "properties": {"data": {"type": "array", "items": _ref("Model")}}},
                            "Model list",
                        ),
                        "401": _ERRORS["401"],
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Readiness",
                    "security": [],
                    "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "security": [],
                    "responses": {"200": {"description": "text exposition"}},
                }
            },
        },
    }
