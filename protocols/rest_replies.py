"""OpenAI-shaped replies: a whole completion, an SSE stream of chunks ending with `data: [DONE]`, and the
error object {"error": {"message", "type", "param", "code"}} with the HTTP status of its `Status`."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.api import Done, Error, Event, TokenChunk
from gateway.errors import Status
from protocols.rest_input import ParsedBody
from protocols.rest_logprobs import ReplyLogprobs

# Status -> (HTTP status, OpenAI error type): the one place REST turns outcomes into wire codes.
HTTP_STATUS: dict[Status, tuple[int, str]] = {
    Status.OK: (200, ""),
    Status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Status.UNAUTHENTICATED: (401, "authentication_error"),
    Status.PERMISSION_DENIED: (403, "permission_error"),
    Status.NOT_FOUND: (404, "not_found_error"),
    Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Status.CANCELLED: (499, "cancelled"),
    Status.INTERNAL: (500, "server_error"),
    Status.UNAVAILABLE: (503, "service_unavailable"),
    Status.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def error_response(
    status: Status,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after_s: float | None = None,
    request_id: str | None = None,
) -> web.Response:
    """The OpenAI-shaped error reply for a gateway `Status`."""
    http, kind = HTTP_STATUS[status]
    headers: dict[str, str] = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    if request_id:
        headers["X-Request-Id"] = request_id
    body = error_body(message, kind, param, code or status.value)
    return web.Response(status=http, body=body, content_type="application/json", headers=headers)


async def whole_reply(events: AsyncIterator[Event], body: ParsedBody, request_id: str, chat: bool) -> web.Response:
    """The completion's JSON reply once its events end; an error event becomes the error reply instead."""
    parts: list[str] = []
    done: Done | None = None
    logprobs = ReplyLogprobs(chat) if body.sampling.logprobs is not None else None
    async for event in events:
        if type(event) is TokenChunk:
            parts.append(event.text)
            if logprobs is not None:
                logprobs.add(event.text, event.logprobs)
        elif type(event) is Done:
            done = event
        elif isinstance(event, Error):
            return event_error(event, request_id)
    if done is None:
        return error_response(Status.INTERNAL, "the request ended without a result", request_id=request_id)
    text = "".join(parts)
    created = int(time.time())
    usage = _usage(done)
    choice: dict[str, Any]
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None if logprobs is None else logprobs.take(),
            "finish_reason": done.finish_reason,
        }
        reply = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [choice],
            "usage": usage,
        }
    else:
        taken = None if logprobs is None else logprobs.take()
        choice = {"index": 0, "text": text, "logprobs": taken, "finish_reason": done.finish_reason}
        reply = {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "choices": [choice],
            "usage": usage,
        }
    headers = {"X-Request-Id": request_id}
    if done.adapter_version:
        headers["X-Adapter-Version"] = done.adapter_version
    return web.Response(body=json.dumps(reply).encode(), content_type="application/json", headers=headers)


async def stream_reply(
    request: web.Request, events: AsyncIterator[Event], body: ParsedBody, request_id: str, chat: bool
) -> web.StreamResponse:
    """The completion as SSE chunks as OpenAI sends them. An error before the first event keeps its HTTP
    status; one after it ends the stream as its last chunk, before `data: [DONE]`."""
    # Wait for the first event before committing to 200, so early failures keep their HTTP status.
    first = await anext(events, None)
    if first is None:
        return error_response(Status.INTERNAL, "the request ended without a result", request_id=request_id)
    if isinstance(first, Error):
        return event_error(first, request_id)
    created = int(time.time())
    model = json.dumps(body.model)
    # A client's X-Request-Id may hold quotes or backslashes: escape it like every other string here.
    if chat:
        chunk_id = json.dumps(f"chatcmpl-{request_id}")
        head = f'{{"id":{chunk_id},"object":"chat.completion.chunk","created":{created},"model":{model}'
        open_text = head + ',"choices":[{"index":0,"delta":{"content":'
        logprobs_key = b'},"logprobs":'
    else:
        chunk_id = json.dumps(f"cmpl-{request_id}")
        head = f'{{"id":{chunk_id},"object":"text_completion","created":{created},"model":{model}'
        open_text = head + ',"choices":[{"index":0,"text":'
        logprobs_key = b',"logprobs":'
    prefix = b"data: " + open_text.encode()
    close = b',"finish_reason":null}]}\n\n'
    suffix = logprobs_key + b"null" + close
    # Chunks of requests that asked for log-probabilities carry those of their tokens; the others a constant.
    logprobs = ReplyLogprobs(chat) if body.sampling.logprobs is not None else None
    headers = {**_SSE_HEADERS, "X-Request-Id": request_id}
    version = first.adapter_version if isinstance(first, TokenChunk | Done) else None
    if version:  # named by the first event, before the headers go out (a JSON reply takes it from `Done`)
        headers["X-Adapter-Version"] = version
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    # The role travels once, in a chunk of its own as OpenAI sends it, but in the same write as the
    # first text; the closing chunks go out with the end of the body. Fewer writes, fewer syscalls.
    pending = b""
    if chat:
        role = (
            ',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
        )
        pending = b"data: " + (head + role).encode() + b"\n\n"
    final = b""
    event: Event | None = first
    while event is not None:
        if type(event) is TokenChunk:
            if logprobs is not None:
                logprobs.add(event.text, event.logprobs)
                suffix = logprobs_key + json.dumps(logprobs.take()).encode() + close
            await response.write(pending + prefix + json.dumps(event.text).encode() + suffix)
            pending = b""
        elif type(event) is Done:
            reason = json.dumps(event.finish_reason)
            if chat:
                last = head + f',"choices":[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":{reason}}}]}}'
            else:
                last = head + f',"choices":[{{"index":0,"text":"","logprobs":null,"finish_reason":{reason}}}]}}'
            final = b"data: " + last.encode() + b"\n\n"
            if body.include_usage:
                usage = head + ',"choices":[],"usage":' + json.dumps(_usage(event)) + "}"
                final += b"data: " + usage.encode() + b"\n\n"
            break
        elif isinstance(event, Error):
            _, kind = HTTP_STATUS[event.status]
            final = b"data: " + error_body(event.message, kind, None, event.status.value) + b"\n\n"
            break
        event = await anext(events, None)
    await response.write_eof(pending + final + _DONE)
    return response


def event_error(event: Error, request_id: str) -> web.Response:
    """The error reply for an `Error` event (an unknown model's carries OpenAI's `model_not_found`)."""
    param = "model" if event.status is Status.NOT_FOUND else None
    code = "model_not_found" if event.status is Status.NOT_FOUND else None
    return error_response(
        event.status,
        event.message,
        param=param,
        code=code,
        retry_after_s=event.retry_after_s,
        request_id=request_id,
    )


def _usage(done: Done) -> dict[str, Any]:
    u = done.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        # OpenAI's prompt caching report: the prompt tokens the engine's prefix cache held.
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
