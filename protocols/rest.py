"""OpenAI-compatible REST and SSE over aiohttp: /v1/completions, /v1/chat/completions, /v1/models, and vLLM's
/tokenize and /detokenize (`rest_tokenize`).

Translation only: a JSON body becomes one `GatewayRequest` per choice (`n`, see `rest_choices`), their event
streams become one JSON reply or SSE `data:` chunks ending with `data: [DONE]`. Every failure leaves as an OpenAI
error object {"error": {"message", "type", "param", "code"}} with the HTTP status from `rest_replies.HTTP_STATUS`;
malformed input is a 4xx naming the problem, never a 500.

Extra headers: `X-Request-Id` (echoed, generated when absent), `X-Routing-Key` (sticky adapter
version choice; the body's `user` field is used when absent), `X-Request-Timeout` (seconds, may
shorten the configured deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from opentelemetry import propagate, trace
from opentelemetry.context import Context

from gateway.api import (
    Error,
    GatewayRequest,
    HealthSource,
    Origin,
    Submitter,
    TokenService,
)
from gateway.errors import GatewayError, InvalidRequest, Status, Unauthenticated
from protocols.openapi import openapi_document
from protocols.rest_choices import ChoiceEvent, choice_requests, close_events, merged_events
from protocols.rest_input import ParsedBody, parse_chat, parse_completion, parse_model
from protocols.rest_replies import error_body, error_response, stream_reply, whole_reply
from protocols.rest_tokenize import detokenize_reply, parse_detokenize, parse_tokenize, tokenize_reply

log = logging.getLogger("adaptergate.rest")
_tracer = trace.get_tracer("adaptergate.rest")

_MAX_REQUEST_ID = 128
_UNGUARDED = frozenset({"/healthz", "/metrics", "/openapi.json"})
# Requests that count in adaptergate_requests_total, refused or not.
_INFERENCE = frozenset({"/v1/chat/completions", "/v1/completions"})
_TENANT = web.RequestKey("tenant", str)  # request storage: the tenant, once authenticated
# After the drain timeout: how long requests that were cut get to send their error before connections close.
_CUT_GRACE_S = 1.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpError(Exception):
    """A REST-level refusal that has no `Status` of its own (e.g. 413, 405)."""

    def __init__(
        self,
        http_status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str = "",
        close: bool = False,
    ):
        super().__init__(message)
        self.http_status = http_status
        self.message = message
        self.kind = kind
        self.code = code
        self.close = close  # the connection cannot carry another request (its body framing is lost)


class RestServer:
    """Serves the OpenAI-compatible API (plus any `extra_routes`) while open; drains on exit."""

    def __init__(
        self,
        gateway: Submitter,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        max_body_bytes: int = 1_048_576,
        request_timeout_s: float = 600.0,
        drain_timeout_s: float = 30.0,
        model_name: str = "base",
        health: HealthSource | None = None,
        extra_routes: Sequence[web.RouteDef] = (),
        tokens: TokenService | None = None,
    ) -> None:
        """`tokens`: what answers /tokenize and /detokenize (without it, they answer 404)."""
        self._gateway = gateway
        self._host = host
        self._port = port
        self._max_body = max_body_bytes
        self._timeout_s = request_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self._model_name = model_name
        self._health = health
        self._extra_routes = list(extra_routes)
        self._tokens = tokens
        self._runner: web.AppRunner | None = None
        self._openapi = json.dumps(openapi_document(model_name)).encode()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._generating: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()
        self.draining = False
        self.port = 0

    async def __aenter__(self) -> RestServer:
        app = web.Application(client_max_size=self._max_body, middlewares=[self._guard])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_get("/openapi.json", self._openapi_json)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_routes(self._extra_routes)
        # Cancel a handler when its client disconnects, so the request leaves the queue or engine.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, backlog=1024)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("REST listening", extra={"host": self._host, "port": self.port})
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.drain()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def drain(self) -> None:
        """Answer 503 to new requests and wait (bounded) for in-flight ones to finish; those still running
        then end with a 503 error (an error chunk in a stream) rather than a dropped connection."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._drain_timeout_s):
                await self._idle.wait()
        if not self._active:
            return
        log.warning("drain timeout: %d requests still running are cut", self._active)
        self._cut = set(self._generating)
        for task in self._cut:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CUT_GRACE_S):
                await self._idle.wait()

    # -- middleware ----------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in _UNGUARDED:
            return await handler(request)
        if self.draining:
            self._refused(request, Status.UNAVAILABLE)
            response = error_response(Status.UNAVAILABLE, "the gateway is shutting down", code="draining")
            response.force_close()
            return response
        self._active += 1
        self._idle.clear()
        # Refusals before a request reaches the gateway echo the client's id too, as OpenAI's errors carry theirs.
        echo = _given_request_id(request.headers.get("X-Request-Id"))
        try:
            return await handler(request)
        except GatewayError as e:
            self._refused(request, e.status)
            return error_response(
                e.status,
                e.message,
                param=getattr(e, "param", None),
                retry_after_s=e.retry_after_s,
                request_id=echo,
            )
        except HttpError as e:
            self._refused(request, Status.INVALID_ARGUMENT if e.http_status < 500 else Status.INTERNAL)
            body = error_body(e.message, e.kind, None, e.code or None)
            headers = {"X-Request-Id": echo} if echo else None
            response = web.Response(status=e.http_status, body=body, content_type="application/json", headers=headers)
            if e.close:
                response.force_close()
            return response
        except web.HTTPException as e:
            if e.status < 400:
                raise
            self._refused(request, Status.INVALID_ARGUMENT)
            message = {404: f"no route for {request.path}", 405: f"method {request.method} not allowed here"}
            text = message.get(e.status, e.reason)
            code = "payload_too_large" if e.status == 413 else e.reason.lower().replace(" ", "_")
            headers = {k: v for k, v in e.headers.items() if k == "Allow"}
            if echo:
                headers["X-Request-Id"] = echo
            return web.Response(
                status=e.status,
                body=error_body(text, "invalid_request_error", None, code),
                content_type="application/json",
                headers=headers,
            )
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            self._refused(request, Status.INTERNAL)
            return error_response(Status.INTERNAL, "internal error", request_id=echo)
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    # -- routes --------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        body = parse_chat(await self._json(request), self._model_name)
        return await self._generate(request, tenant, body, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        body = parse_completion(await self._json(request), self._model_name)
        return await self._generate(request, tenant, body, chat=False)

    async def _tokenize(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        body = parse_tokenize(await self._json(request), self._model_name, tenant)
        echo = _given_request_id(request.headers.get("X-Request-Id"))
        return await tokenize_reply(self._token_service(), body, echo)

    async def _detokenize(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        body = parse_detokenize(await self._json(request), self._model_name, tenant)
        echo = _given_request_id(request.headers.get("X-Request-Id"))
        return await detokenize_reply(self._token_service(), body, echo)

    def _token_service(self) -> TokenService:
        if self._tokens is None:
            raise HttpError(404, "tokenization is not served here", code="not_found")
        return self._tokens

    async def _models(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        data = [self._model_entry(name) for name in self._gateway.models_for(tenant)]
        return web.json_response({"object": "list", "data": data})

    async def _model(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        name = request.match_info["model"]
        # Every spelling a completion accepts ("base", the base model's name, "ADAPTER", "base:ADAPTER") names a
        # model here too: clients check models.retrieve(model) before they use it.
        try:
            adapter = parse_model(name, self._model_name)
        except GatewayError:  # "base:" names no model
            adapter = name
        served = self._gateway.models_for(tenant)
        if name not in served and ("base" if adapter is None else adapter) not in served:
            # The same code as a completion request for an unknown model gets (see rest_replies.event_error).
            message = f"The model {name!r} does not exist or you do not have access to it."
            echo = _given_request_id(request.headers.get("X-Request-Id"))
            return error_response(Status.NOT_FOUND, message, param="model", code="model_not_found", request_id=echo)
        return web.json_response(self._model_entry(name))

    async def _openapi_json(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def _healthz(self, request: web.Request) -> web.Response:
        ok, detail = self._health.health() if self._health is not None else (True, "")
        if self.draining:
            ok, detail = False, "draining"
        return web.json_response({"status": "ok" if ok else "unavailable", "detail": detail}, status=200 if ok else 503)

    def _model_entry(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "adaptergate", "root": self._model_name}

    # -- generation ----------------------------------------------------------------------------

    async def _generate(self, request: web.Request, tenant: str, body: ParsedBody, *, chat: bool) -> web.StreamResponse:
        headers = request.headers
        request_id = _request_id(headers.get("X-Request-Id"))
        timeout = self._timeout_s
        asked = headers.get("X-Request-Timeout")
        if asked is not None:
            timeout = min(timeout, _positive_seconds(asked))
        # The protocol span is the root of the request's trace (or joins the caller's, via traceparent);
        # the core's queue and engine spans hang below it through `trace_context`.
        parent = propagate.extract(headers) if "traceparent" in headers else None
        span = _tracer.start_span(f"{request.method} {request.path}", context=parent, kind=trace.SpanKind.SERVER)
        span.set_attribute("adaptergate.request_id", request_id)
        carrier: dict[str, str] = {}
        if span.get_span_context().is_valid:
            propagate.inject(carrier, context=trace.set_span_in_context(span, Context()))
        greq = GatewayRequest(
            request_id=request_id,
            tenant=tenant,
            adapter=body.adapter,
            prompt=body.prompt,
            messages=body.messages,
            sampling=body.sampling,
            stream=body.stream,
            deadline=time.monotonic() + timeout,
            protocol=Origin.REST,
            routing_key=headers.get("X-Routing-Key") or body.user,
            cache_salt=body.cache_salt,
            trace_context=carrier,
        )
        requests = choice_requests(greq, body.n)
        events = self._until_cut(merged_events(self._gateway.submit, requests))
        task = asyncio.current_task()
        if task is not None:
            self._generating.add(task)
        try:
            if body.stream:
                response = await stream_reply(request, events, body, request_id, chat)
            else:
                response = await whole_reply(events, body, request_id, chat)
            span.set_attribute("http.response.status_code", response.status)
            return response
        finally:
            # Closing the stream early is how the core learns the client is gone (every choice's request).
            await close_events(events)
            span.end()
            if task is not None:
                self._generating.discard(task)

    async def _until_cut(self, events: AsyncIterator[ChoiceEvent]) -> AsyncIterator[ChoiceEvent]:
        """`events`, ending with an UNAVAILABLE error if `drain` cuts the request (it cancels the handler: the
        request leaves the queue or its engine as for a client that went away, but this client hears why)."""
        try:
            async for event in events:
                yield event
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task not in self._cut:
                raise
            if task.uncancel():  # cancelled for another reason as well (the client went away): that one stands
                raise
            yield 0, Error(Status.UNAVAILABLE, "the gateway shut down before the request finished (drain timeout)")
        finally:
            await close_events(events)

    def _tenant(self, request: web.Request) -> str:
        auth = request.headers.get("Authorization")
        key: str | None = None
        if auth:
            scheme, _, value = auth.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise Unauthenticated("Authorization header must be 'Bearer <API key>'")
            key = value.strip()
        tenant = self._gateway.authenticate(key)
        request[_TENANT] = tenant
        return tenant

    def _refused(self, request: web.Request, status: Status) -> None:
        """Count an inference request refused before it reached `submit` (the core counts the rest)."""
        if request.path in _INFERENCE:
            self._gateway.refused(request.get(_TENANT), status, Origin.REST)

    async def _json(self, request: web.Request) -> object:
        length = request.content_length
        if length is not None and length > self._max_body:
            raise HttpError(
                413, f"request body of {length} bytes exceeds the limit of {self._max_body}", code="payload_too_large"
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(
                413, f"request body exceeds the limit of {self._max_body} bytes", code="payload_too_large"
            ) from None
        except RequestPayloadError:
            # A body its Content-Encoding cannot decode (or cut short): bad input, not a 500. The rest of the
            # body cannot be skipped, so the connection closes; marking the body read stops aiohttp from trying
            # (and logging the same error again as unhandled).
            request.content.feed_eof()
            encoding = request.headers.get("Content-Encoding", "identity")
            raise HttpError(
                400, f"request body could not be read as Content-Encoding {encoding!r}", code="invalid_body", close=True
            ) from None
        if not raw:
            raise InvalidRequest("request body is empty; expected a JSON object")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidRequest("request body is nested too deeply") from None


def _request_id(given: str | None) -> str:
    return _given_request_id(given) or uuid.uuid4().hex


def _given_request_id(given: str | None) -> str | None:
    """The client's X-Request-Id if it is usable (1-128 printable ASCII characters, no spaces), else None."""
    if given and len(given) <= _MAX_REQUEST_ID and given.isascii() and given.isprintable() and " " not in given:
        return given
    return None


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequest(f"X-Request-Timeout must be a positive number of seconds, got {value!r}")
    return seconds
