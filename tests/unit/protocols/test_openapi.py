"""The served OpenAPI document against the real REST layer, checked mechanically.

- Request schemas vs `rest_input`: the fields the parser reads are exactly the documented ones, and for
  every field and a pool of values (plus each bound's edges) the schema accepts a body iff the parser does.
- Paths vs the aiohttp app the gateway really builds (admin API and /metrics included).
- Replies (JSON, SSE chunks, errors) vs their documented schemas and statuses, and vs the `openai` client's types.

No JSON-schema library is installed, so `_conforms` implements the keywords the document uses and fails
on any other, so that a keyword it does not understand cannot pass unnoticed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.config import from_dict
from protocols.openapi import openapi_document
from protocols.rest import RestServer, _request_id
from protocols.rest_input import FieldError, parse_chat, parse_completion
from tests.unit.protocols.test_rest import KEY, FakeGateway
from tests.unit.protocols.test_rest_logprobs import LogprobsGateway

DOC = openapi_document("smol")
SCHEMAS = DOC["components"]["schemas"]
_ANNOTATIONS = {"description", "examples", "title"}
_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


# -- a small JSON-schema validator for the keywords the document uses -------------------------------------


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/"), ref
        node: Any = DOC
        for part in ref[2:].split("/"):
            node = node[part]
        schema = {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _same(a: object, b: object) -> bool:
    """JSON equality: true is not 1, but 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


_TYPES: dict[str, Callable[[object], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) is int or (type(v) is float and math.isfinite(v)),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _conforms(schema: dict[str, Any], value: object) -> bool:
    s = _resolve(schema)
    known = {
        "type", "enum", "const", "not", "oneOf", "anyOf", "minimum", "maximum", "exclusiveMinimum",
        "minLength", "maxLength", "pattern", "items", "minItems", "maxItems", "properties", "required",
        "maxProperties", "propertyNames", "additionalProperties",
    }  # fmt: skip
    unknown = set(s) - known - _ANNOTATIONS
    assert not unknown, f"validator does not implement {unknown}"
    if "type" in s:
        types = [s["type"]] if isinstance(s["type"], str) else s["type"]
        if not any(_TYPES[t](value) for t in types):
            return False
    if "enum" in s and not any(_same(value, e) for e in s["enum"]):
        return False
    if "const" in s and not _same(value, s["const"]):
        return False
    if "not" in s and _conforms(s["not"], value):
        return False
    if "oneOf" in s and sum(_conforms(sub, value) for sub in s["oneOf"]) != 1:
        return False
    if "anyOf" in s and not any(_conforms(sub, value) for sub in s["anyOf"]):
        return False
    if _TYPES["number"](value) and not isinstance(value, bool):
        assert isinstance(value, int | float)
        if "minimum" in s and value < s["minimum"]:
            return False
        if "maximum" in s and value > s["maximum"]:
            return False
        if "exclusiveMinimum" in s and value <= s["exclusiveMinimum"]:
            return False
    if isinstance(value, str):
        if len(value) < s.get("minLength", 0) or len(value) > s.get("maxLength", math.inf):
            return False
        if "pattern" in s and not re.search(s["pattern"], value):
            return False
    if isinstance(value, list):
        if not s.get("minItems", 0) <= len(value) <= s.get("maxItems", math.inf):
            return False
        if "items" in s and not all(_conforms(s["items"], item) for item in value):
            return False
    if isinstance(value, dict):
        if any(name not in value for name in s.get("required", ())):
            return False
        if len(value) > s.get("maxProperties", math.inf):
            return False
        for name, sub in s.get("properties", {}).items():
            if name in value and not _conforms(sub, value[name]):
                return False
        if "propertyNames" in s and not all(_conforms(s["propertyNames"], name) for name in value):
            return False
        others = [v for name, v in value.items() if name not in s.get("properties", {})]
        if "additionalProperties" in s and not all(_conforms(s["additionalProperties"], v) for v in others):
            return False
    return True


def test_the_validator_itself() -> None:
    assert _conforms({"type": "integer", "minimum": 1}, 1)
    assert not _conforms({"type": "integer", "minimum": 1}, 0)
    assert not _conforms({"type": "integer"}, True)
    assert not _conforms({"type": ["number", "null"], "enum": [0, None]}, False)
    assert _conforms({"type": ["number", "null"], "enum": [0, None]}, 0.0)
    assert not _conforms(SCHEMAS["Error"], {"error": {"message": "m", "type": "t", "param": None}})
    names = {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "additionalProperties": {"type": "number"}}
    assert _conforms(names, {"5": 1}) and not _conforms(names, {"x": 1}) and not _conforms(names, {"5": "a"})
    with pytest.raises(AssertionError, match="does not implement"):
        _conforms({"uniqueItems": True}, [])


# -- the document as an OpenAPI document --------------------------------------------------------------------


def _walk(node: object) -> list[object]:
    out = [node]
    if isinstance(node, dict):
        for v in node.values():
            out += _walk(v)
    elif isinstance(node, list):
        for v in node:
            out += _walk(v)
    return out


def test_document_is_well_formed() -> None:
    assert DOC["openapi"] == "3.1.0" and {"title", "version"} <= set(DOC["info"])
    assert json.loads(json.dumps(DOC)) == DOC
    for node in _walk(DOC):
        if isinstance(node, dict) and "$ref" in node:
            _resolve(node)  # every reference resolves
    schemes = set(DOC["components"]["securitySchemes"])
    for path, item in DOC["paths"].items():
        assert path.startswith("/")
        for method, op in item.items():
            assert method in _METHODS, (path, method)
            assert op["responses"] and all(re.fullmatch(r"[1-5]\d\d", code) for code in op["responses"])
            assert all("description" in r for r in op["responses"].values())
            for requirement in op.get("security", DOC["security"]):
                assert set(requirement) <= schemes
            declared = {p["name"] for p in op.get("parameters", ()) if p["in"] == "path"}
            assert declared == set(re.findall(r"{(\w+)}", path)), (path, method)
            assert all(p.get("required") for p in op.get("parameters", ()) if p["in"] == "path")


# -- request schemas against the parser ------------------------------------------------------------------


class _Recording(dict[str, Any]):
    """A body that notes which top-level fields the parser looks at."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


ENDPOINTS = {
    "chat": (parse_chat, "ChatCompletionRequest", "/v1/chat/completions"),
    "completion": (parse_completion, "CompletionRequest", "/v1/completions"),
}

_POOL: list[object] = [
    None, True, False, 0, 1, 2, -1, 0.0, 0.5, 1.5, 2.5, 10**400, -(10**400), "", "x", "none", "auto", "text",
    [], ["x"], ["a", "b"], ["a", "b", "c", "d", "e"], [1], [[1, 2]], {}, {"a": 1}, {"type": "text"},
    {"type": "json_object"}, {"include_usage": True}, {"include_usage": "yes"}, {"include_usage": None},
    {"0": -100, "50256": 100.0}, {"7": 100.5}, {"7": True}, {"7": None}, {"07": 1}, {"-1": 1}, {"1000000000": 1},
    {str(i): 1 for i in range(301)}, [0, 999999999], [-1], [1000000000], [True], [2.0], list(range(65)),
]  # fmt: skip
# Fields whose bound is another field's value, which a schema cannot say: checked without that field here (a base
# body with it refuses values the schema allows), and against it in test_rest.
_BOUNDED_BY = {"min_tokens": ("max_tokens", "max_completion_tokens")}
_MESSAGES: list[object] = [
    [{"role": "user", "content": "x"}],
    [{"role": "developer", "content": "x", "name": "n"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    [{"role": "user", "content": []}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": None}],
    [{"role": "user"}],
    [{"role": "tool", "content": "x"}],
    [{"role": ["user"], "content": "x"}],
    ["x"],
]


def _edges(schema: dict[str, Any]) -> list[object]:
    """Values on and just past each bound, and each listed value, of a property schema and its branches."""
    out: list[object] = []
    for s in [schema, *schema.get("oneOf", ()), *schema.get("anyOf", ())]:
        s = _resolve(s)
        types = [s["type"]] if isinstance(s.get("type"), str) else s.get("type", [])
        step: float = 1 if "integer" in types else 1e-9
        for key, delta in (("minimum", -step), ("maximum", step), ("exclusiveMinimum", 0.0)):
            if key in s:
                out += [s[key], s[key] + delta]
        out += s.get("enum", []) + ([s["const"]] if "const" in s else [])
    return out


def _parses(parse: Callable[[object, str], object], body: object) -> tuple[bool, str | None]:
    try:
        parse(body, "smol")
    except FieldError as e:
        return False, e.param
    return True, None


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_documented_request_fields_are_the_ones_the_parser_reads(endpoint: str) -> None:
    parse, name, _ = ENDPOINTS[endpoint]
    body = _Recording(SCHEMAS[name]["examples"][0])
    parse(body, "smol")
    assert body.read == set(SCHEMAS[name]["properties"])


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_request_schema_accepts_exactly_what_the_parser_accepts(endpoint: str) -> None:
    parse, name, _ = ENDPOINTS[endpoint]
    schema = SCHEMAS[name]
    base = schema["examples"][0]
    mismatches = []
    for field, prop in schema["properties"].items():
        values = [*_POOL, *_edges(prop), *(_MESSAGES if field == "messages" else ())]
        unbounded = {k: v for k, v in base.items() if k not in _BOUNDED_BY.get(field, ())}
        for value in values:
            body = {**unbounded, field: value}
            documented = _conforms(schema, body)
            accepted, param = _parses(parse, body)
            if documented != accepted:
                mismatches.append(f"{field}={repr(value)[:60]}: schema says {documented}, parser says {accepted}")
            elif not accepted and not (param or "").startswith(field):
                mismatches.append(f"{field}={repr(value)[:60]}: refused naming {param!r}")
    for field in schema["required"]:
        body = {k: v for k, v in base.items() if k != field}
        assert not _conforms(schema, body) and _parses(parse, body) == (False, field)
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_document_examples_are_accepted(endpoint: str) -> None:
    parse, name, _ = ENDPOINTS[endpoint]
    for example in SCHEMAS[name]["examples"]:
        assert _conforms(SCHEMAS[name], example)
        assert _parses(parse, example) == (True, None)


def test_request_id_header_pattern_matches_what_is_echoed() -> None:
    (param,) = [p for p in DOC["paths"]["/v1/completions"]["post"]["parameters"] if p["name"] == "X-Request-Id"]
    for value in ["a", "r-1", 'q"\\', "x" * 128, "x" * 129, "", "a b", "é", "tab\there", "~!"]:
        assert _conforms(param["schema"], value) == (_request_id(value) == value), value


# -- paths against the app the gateway builds ---------------------------------------------------------------


class _Metrics:
    content_type = "text/plain"

    def render(self) -> bytes:
        return b""


async def test_every_registered_route_is_documented_and_nothing_else() -> None:
    from gateway.__main__ import build_protocols

    gateway = FakeGateway()
    gateway.metrics = _Metrics()  # type: ignore[attr-defined]
    # The extra routes exactly as `adaptergate serve` wires them (admin API, /metrics) ...
    (wired,) = build_protocols(from_dict({}))(gateway)  # type: ignore[arg-type]
    assert isinstance(wired, RestServer)
    # ... on a server of our own, on a free port.
    async with RestServer(gateway, port=0, extra_routes=wired._extra_routes) as server:
        assert server._runner is not None
        registered = {
            (route.resource.canonical, route.method.lower())
            for route in server._runner.app.router.routes()
            if route.resource is not None and route.method != "HEAD"  # aiohttp adds HEAD to every GET
        }
    documented = {(path, method) for path, item in DOC["paths"].items() for method in item}
    assert registered == documented


# -- replies against the response schemas -----------------------------------------------------------------


@pytest.fixture
async def url() -> AsyncIterator[str]:
    gateway = FakeGateway()
    async with RestServer(gateway, port=0, max_body_bytes=4096, model_name="smol", health=gateway) as server:
        yield f"http://127.0.0.1:{server.port}"


def _response_schema(path: str, method: str, status: int, content_type: str) -> dict[str, Any]:
    responses = DOC["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} answered {status}, which is not documented"
    content = responses[str(status)]["content"]
    assert content_type in content, f"{method.upper()} {path} {status} answered {content_type}"
    schema: dict[str, Any] = content[content_type]["schema"]
    return schema


async def _check(response: aiohttp.ClientResponse, path: str, method: str = "post") -> Any:
    reply = await response.json()
    assert _conforms(_response_schema(path, method, response.status, "application/json"), reply), reply
    return reply


async def test_json_replies_match_the_document_and_the_openai_types(url: str) -> None:
    async with aiohttp.ClientSession(headers=KEY) as http:
        for n in (1, 3):
            chat = {"model": "pirate", "messages": [{"role": "user", "content": "hi"}], "n": n}
            async with http.post(f"{url}/v1/chat/completions", json=chat) as r:
                ChatCompletion.model_validate(await _check(r, "/v1/chat/completions"))
            async with http.post(f"{url}/v1/completions", json={"model": "base", "prompt": "x", "n": n}) as r:
                assert len(Completion.model_validate(await _check(r, "/v1/completions")).choices) == n
        async with http.get(f"{url}/v1/models") as r:
            listed = await _check(r, "/v1/models", "get")
            assert [Model.model_validate(m).id for m in listed["data"]] == ["base", "pirate"]
        async with http.get(f"{url}/v1/models/pirate") as r:
            Model.model_validate(await _check(r, "/v1/models/{model}", "get"))
    async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as r:
        await _check(r, "/healthz", "get")


@pytest.mark.parametrize(
    ("path", "body", "chunk"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, ChatCompletionChunk),
        ("/v1/completions", {"prompt": "x"}, Completion),
    ],
)
@pytest.mark.parametrize(("model", "n"), [("pirate", 1), ("pirate", 3), ("midfail", 1)])
async def test_sse_chunks_match_the_document_and_the_openai_types(
    url: str, path: str, body: dict[str, Any], chunk: type[Any], model: str, n: int
) -> None:
    request = {**body, "model": model, "n": n, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(headers=KEY) as http, http.post(f"{url}{path}", json=request) as r:
        assert r.status == 200
        text = await r.text()
    schema = _response_schema(path, "post", 200, "text/event-stream")
    chunk_name = re.search(r"data: \{(\w+)\}", schema["description"])
    assert chunk_name is not None and text.endswith("data: [DONE]\n\n")
    events = [json.loads(block.removeprefix("data: ")) for block in text.split("\n\n")[:-2]]
    for event in events[:-1]:
        assert _conforms(_ref(chunk_name[1]), event), event
        if chunk is Completion and event["choices"] and event["choices"][0]["finish_reason"] is None:
            # openai types a streamed completion like a whole one (finish_reason required), though OpenAI's own
            # chunks carry null until the last; the client builds chunks without validating, so only check the rest.
            event = {**event, "choices": [{**event["choices"][0], "finish_reason": "stop"}]}
        chunk.model_validate(event)
    if model == "midfail":
        assert _conforms(_ref("Error"), events[-1])
    else:
        assert _conforms(_ref(chunk_name[1]), events[-1])
        assert events[-1]["choices"] == [] and chunk.model_validate(events[-1]).usage.total_tokens == 3 + 3 * n


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


@pytest.mark.parametrize(
    ("path", "body", "whole", "chunk"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
            ChatCompletion,
            ChatCompletionChunk,
        ),
        ("/v1/completions", {"prompt": "x", "logprobs": 2}, Completion, Completion),
    ],
)
async def test_replies_with_logprobs_match_the_document_and_the_openai_types(
    path: str, body: dict[str, Any], whole: type[Any], chunk: type[Any]
) -> None:
    gateway = LogprobsGateway()
    async with RestServer(gateway, port=0, model_name="smol") as server, aiohttp.ClientSession(headers=KEY) as http:
        url = f"http://127.0.0.1:{server.port}{path}"
        async with http.post(url, json={**body, "model": "base"}) as r:
            logprobs = whole.model_validate(await _check(r, path)).choices[0].logprobs
        async with http.post(url, json={**body, "model": "base", "stream": True}) as r:
            text = await r.text()
    if chunk is ChatCompletionChunk:
        assert [e.token for e in logprobs.content[2].top_logprobs] == ["alt1", "alt2"]
    else:
        assert logprobs.text_offset == [0, 3, 5, 15] and logprobs.top_logprobs[2]["alt2"] == -2.0
    events = [json.loads(block.removeprefix("data: ")) for block in text.split("\n\n")[:-2]]
    name = "ChatCompletionChunk" if chunk is ChatCompletionChunk else "CompletionChunk"
    for event in events:
        assert _conforms(_ref(name), event), event
        if chunk is Completion:  # finish_reason required by the openai type (see the test above)
            event = {**event, "choices": [{**event["choices"][0], "finish_reason": "stop"}]}
        chunk.model_validate(event)
    assert sum(1 for e in events if e["choices"][0]["logprobs"]) == 3  # one per chunk with tokens


_HI = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("method", "path", "template", "headers", "body", "status"),
    [
        ("post", "/v1/chat/completions", None, KEY, {"model": "base", "messages": []}, 400),
        ("post", "/v1/chat/completions", None, KEY, {"model": "nope", "messages": _HI}, 404),
        ("post", "/v1/completions", None, KEY, {"model": "busy", "prompt": "x"}, 429),
        ("post", "/v1/completions", None, {}, {"model": "base", "prompt": "x"}, 401),
        ("post", "/v1/completions", None, KEY, {"model": "base", "prompt": "x" * 5000}, 413),
        ("get", "/v1/models", None, {}, None, 401),
        ("get", "/v1/models/ghost", "/v1/models/{model}", KEY, None, 404),
    ],
)  # fmt: skip
async def test_error_replies_match_the_document(
    url: str, method: str, path: str, template: str | None, headers: dict[str, str], body: Any, status: int
) -> None:
    async with aiohttp.ClientSession() as http, http.request(method, f"{url}{path}", json=body, headers=headers) as r:
        assert r.status == status
        await _check(r, template or path, method)


async def test_unknown_model_errors_agree_between_endpoints(url: str) -> None:
    # /v1/models/{model} once answered code "not_found" where a completion for the same model says "model_not_found".
    async with aiohttp.ClientSession(headers=KEY) as http:
        async with http.get(f"{url}/v1/models/nope") as r:
            listed = (await r.json())["error"]
        async with http.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}) as r:
            generated = (await r.json())["error"]
    assert (listed["param"], listed["code"]) == (generated["param"], generated["code"]) == ("model", "model_not_found")


async def test_openai_client_sees_the_request_id_of_a_refused_request(url: str) -> None:
    # The README promises the X-Request-Id echo; refusals by the parser once answered without it.
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="good", max_retries=0, default_headers={"X-Request-Id": "mine-1"}
    )
    async with client:
        with pytest.raises(openai.BadRequestError, match="frequency_penalty") as caught:
            await client.chat.completions.create(
                model="base", messages=[{"role": "user", "content": "x"}], frequency_penalty=3.0
            )
    assert caught.value.request_id == "mine-1"
    assert caught.value.body == {
        "message": "frequency_penalty must be between -2 and 2, got 3.0",
        "type": "invalid_request_error",
        "param": "frequency_penalty",
        "code": "invalid_argument",
    }
