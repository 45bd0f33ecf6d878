"""OpenAI-shaped replies: a whole completion, an SSE stream of chunks ending with `data: [DONE]` (either with
the `n` choices of the request), and the error object {"error": {"message", "type", "param", "code"}} with the
HTTP status of its `Status`."""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from gateway.api import Done, Error, PromptLogprobs, TokenChunk
from gateway.errors import Status
from protocols.rest_choices import ChoiceEvent
from protocols.rest_input import ParsedBody
from protocols.rest_logprobs import ReplyLogprobs, prompt_logprobs_reply

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


async def whole_reply(
    events: AsyncIterator[ChoiceEvent], body: ParsedBody, request_id: str, chat: bool
) -> web.Response:
    """The completion's JSON reply once every choice's events end; an error event of any choice becomes the
    error reply instead (the caller's closing of `events` cancels the other choices)."""
    n = body.n
    parts: list[list[str]] = [[] for _ in range(n)]
    dones: list[Done | None] = [None] * n
    logprobs = [ReplyLogprobs(chat) for _ in range(n)] if body.sampling.logprobs is not None else None
    prompts: list[PromptLogprobs | None] = [None] * n
    async for index, event in events:
        if type(event) is TokenChunk or type(event) is Done:
            if event.prompt_logprobs is not None:  # on the first event: before its own entries
                prompts[index] = event.prompt_logprobs
                if body.echo and logprobs is not None:
                    logprobs[index].add_prompt(body.prompt or "", event.prompt_logprobs, body.sampling.logprobs or 0)
        if type(event) is TokenChunk:
            parts[index].append(event.text)
            if logprobs is not None:
                logprobs[index].add(event.text, event.logprobs)
        elif type(event) is Done:
            dones[index] = event
        elif isinstance(event, Error):
            return event_error(event, request_id, body)
    finished = [done for done in dones if done is not None]
    if len(finished) < n:
        return error_response(Status.INTERNAL, "the request ended without a result", request_id=request_id)
    choices: list[dict[str, Any]] = []
    for index, done in enumerate(finished):
        text = "".join(parts[index])
        taken = None if logprobs is None else logprobs[index].take()
        if chat:
            message = {"role": "assistant", "content": text}
            choices.append({"index": index, "message": message, "logprobs": taken, "finish_reason": done.finish_reason})
        else:
            text = (body.prompt or "") + text if body.echo else text
            choices.append({"index": index, "text": text, "logprobs": taken, "finish_reason": done.finish_reason})
            if body.prompt_logprobs is not None:  # vLLM's: a field of each completion choice
                choices[-1]["prompt_logprobs"] = _prompt_logprobs(prompts[index], body.prompt_logprobs)
    reply: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": _usage(finished),
    }
    if chat and body.prompt_logprobs is not None:  # vLLM's: a field of the chat reply (the choices share a prompt)
        reply["prompt_logprobs"] = _prompt_logprobs(prompts[0], body.prompt_logprobs)
    headers = {"X-Request-Id": request_id}
    if finished[0].adapter_version:
        headers["X-Adapter-Version"] = finished[0].adapter_version
    return web.Response(body=json.dumps(reply).encode(), content_type="application/json", headers=headers)


async def stream_reply(
    request: web.Request, events: AsyncIterator[ChoiceEvent], body: ParsedBody, request_id: str, chat: bool
) -> web.StreamResponse:
    """The completion as SSE chunks as OpenAI sends them, the chunks of several choices interleaved, each
    naming its choice's index. An error before every choice's first event keeps its HTTP status (and no
    choice is streamed); one after it ends the stream as its last chunk, before `data: [DONE]`."""
    # Wait for every choice's first event before committing to 200, so early failures keep their HTTP status
    # (a refusal of any choice refuses the request). Events of choices that started meanwhile are held.
    n = body.n
    held: deque[ChoiceEvent] = deque()
    started: set[int] = set()
    while len(started) < n:
        tagged = await anext(events, None)
        if tagged is None:
            return error_response(Status.INTERNAL, "the request ended without a result", request_id=request_id)
        if isinstance(tagged[1], Error):
            return event_error(tagged[1], request_id, body)
        started.add(tagged[0])
        held.append(tagged)
    created = int(time.time())
    model = json.dumps(body.model)
    # A client's X-Request-Id may hold quotes or backslashes: escape it like every other string here.
    if chat:
        chunk_id = json.dumps(f"chatcmpl-{request_id}")
        head = f'{{"id":{chunk_id},"object":"chat.completion.chunk","created":{created},"model":{model}'
        opening = ',"delta":{"content":'
        logprobs_key = b'},"logprobs":'
    else:
        chunk_id = json.dumps(f"cmpl-{request_id}")
        head = f'{{"id":{chunk_id},"object":"text_completion","created":{created},"model":{model}'
        opening = ',"text":'
        logprobs_key = b',"logprobs":'
    prefixes = [b"data: " + f'{head},"choices":[{{"index":{i}{opening}'.encode() for i in range(n)]
    close = b',"finish_reason":null}]}\n\n'
    plain = logprobs_key + b"null" + close
    # Chunks of requests that asked for log-probabilities carry those of their tokens; the others a constant.
    logprobs = [ReplyLogprobs(chat) for _ in range(n)] if body.sampling.logprobs is not None else None

    def suffix_of(index: int) -> bytes:
        """The end of a text chunk of choice `index`: the log-probabilities added since its last chunk."""
        if logprobs is None:
            return plain
        return logprobs_key + json.dumps(logprobs[index].take()).encode() + close

    headers = {**_SSE_HEADERS, "X-Request-Id": request_id}
    first = held[0][1]
    version = first.adapter_version if isinstance(first, TokenChunk | Done) else None
    if version:  # named by the first event, before the headers go out (a JSON reply takes it from `Done`)
        headers["X-Adapter-Version"] = version
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    # The role travels once per choice, in a chunk of its own as OpenAI sends it, but in the same write as the
    # first text; the closing chunks go out with the end of the body. Fewer writes, fewer syscalls.
    pending = b""
    if chat:
        for i in range(n):
            role = f',"choices":[{{"index":{i},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
            pending += b"data: " + (head + role + '"finish_reason":null}]}').encode() + b"\n\n"
    final = b""
    dones: list[Done] = []
    echoing = set(range(n)) if body.echo else set()  # choices whose prompt is still to go out (vLLM's echo)
    while True:
        tagged = held.popleft() if held else await anext(events, None)
        if tagged is None:
            break
        index, event = tagged
        text = event.text if type(event) is TokenChunk else ""
        if index in echoing and (type(event) is TokenChunk or type(event) is Done):
            # The prompt goes first: with the choice's first chunk, or in a chunk of its own before its end.
            echoing.discard(index)
            if logprobs is not None and event.prompt_logprobs is not None:
                logprobs[index].add_prompt(body.prompt or "", event.prompt_logprobs, body.sampling.logprobs or 0)
            text = (body.prompt or "") + text
            if type(event) is Done:
                await response.write(pending + prefixes[index] + json.dumps(text).encode() + suffix_of(index))
                pending = b""
        if type(event) is TokenChunk:
            if logprobs is not None:
                logprobs[index].add(event.text, event.logprobs)
            await response.write(pending + prefixes[index] + json.dumps(text).encode() + suffix_of(index))
            pending = b""
        elif type(event) is Done:
            reason = json.dumps(event.finish_reason)
            delta = '"delta":{}' if chat else '"text":""'
            last = f'{head},"choices":[{{"index":{index},{delta},"logprobs":null,"finish_reason":{reason}}}]}}'
            dones.append(event)
            if len(dones) < n:  # the others go on: this choice's end goes out now
                await response.write(pending + b"data: " + last.encode() + b"\n\n")
                pending = b""
                continue
            final = b"data: " + last.encode() + b"\n\n"
            if body.include_usage:
                usage = head + ',"choices":[],"usage":' + json.dumps(_usage(dones)) + "}"
                final += b"data: " + usage.encode() + b"\n\n"
            break
        elif isinstance(event, Error):
            _, kind = HTTP_STATUS[event.status]
            final = b"data: " + error_body(event.message, kind, None, event.status.value) + b"\n\n"
            break
    await response.write_eof(pending + final + _DONE)
    return response


# How the engine words a structured output it cannot compile (engine/structured.py, vLLM's words).
_GRAMMAR_REFUSALS = ("Failed to transform", "Invalid grammar specification")


def event_error(event: Error, request_id: str, body: ParsedBody) -> web.Response:
    """The error reply for an `Error` event (an unknown model's carries OpenAI's `model_not_found`; the engine's
    refusal of a schema, regex or grammar names the field it came from)."""
    param = "model" if event.status is Status.NOT_FOUND else None
    if event.status is Status.INVALID_ARGUMENT and event.message.startswith(_GRAMMAR_REFUSALS):
        param = body.structured_field
    code = "model_not_found" if event.status is Status.NOT_FOUND else None
    return error_response(
        event.status,
        event.message,
        param=param,
        code=code,
        retry_after_s=event.retry_after_s,
        request_id=request_id,
    )


def _prompt_logprobs(prompt: PromptLogprobs | None, top: int) -> list[dict[str, dict[str, Any]] | None] | None:
    return None if prompt is None else prompt_logprobs_reply(prompt, top)


def _usage(dones: Sequence[Done]) -> dict[str, Any]:
    """The usage of a request's choices: one prompt (the same for all), the completions of every choice."""
    prompt = dones[0].usage.prompt_tokens
    completion = sum(done.usage.completion_tokens for done in dones)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # OpenAI's prompt caching report: the prompt tokens the engine's prefix cache held (the first choice's).
        "prompt_tokens_details": {"cached_tokens": dones[0].usage.cached_tokens},
    }
