"""Validation of OpenAI request bodies: JSON in, a `ParsedBody` out, or a `FieldError` naming the field.

Only what the gateway can honour is accepted; anything it would silently ignore in a way that changes
the answer (best_of > 1, tools, several prompts) is refused with a 400 that says so.
protocols/openapi.py describes exactly this; tests/unit/protocols/test_openapi.py holds the two together.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from gateway.api import ChatMessage, SamplingParams
from gateway.errors import GatewayError, Status

# No "tool": tools are refused, so a tool result has no call to answer (the engine's chat template has no such role).
_ROLES = frozenset({"system", "developer", "user", "assistant"})
_MAX_STOP = 4
# The engine's wire format carries top_k and min_tokens as uint32, seed as uint64 (OpenAI's seeds are int64,
# which the engine client takes mod 2^64), and repetition_penalty as float32, whose largest value bounds it.
_MAX_TOP_K = _MAX_MIN_TOKENS = 2**32 - 1
_MAX_FLOAT32 = 3.4028234663852886e38
_MIN_SEED, _MAX_SEED = -(2**63), 2**64 - 1
# The most likely tokens a request may ask for beside each sampled one: vLLM's default max_logprobs, OpenAI's
# top_logprobs bound, and the engine's (engine/logprobs.py).
_MAX_LOGPROBS = 20
# Choices per request (`n`): OpenAI allows up to 128, vLLM up to VLLM_MAX_N_SEQUENCES (16384). Each choice is a
# request of its own in the tenant's queue (protocols/rest_choices.py), and a tenant's default queue depth is 64.
MAX_CHOICES = 16
# vLLM's cache_salt is a secret of the client's (it suggests 43 base64 characters); bounded as the body is.
MAX_CACHE_SALT = 1024
# OpenAI's logit_bias: at most 300 token ids, written in decimal (no leading zeros, so each names one id; nine
# digits at most, past any vocabulary and within the wire's uint32), each biased within [-100, 100].
_MAX_LOGIT_BIAS = 300
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,8}")
MAX_TOKEN_ID = 10**9 - 1
# vLLM's stop_token_ids: at most 64 token ids (ours; vLLM sets no bound), each within the same range; ids past
# the vocabulary are the engine's to refuse (it knows the vocabulary).
_MAX_STOP_TOKEN_IDS = 64
# vLLM's extra sampling fields -> their no-op values (null is one too). top_k is honoured, its -1 ("off") included.
_VLLM_NO_OPS: dict[str, tuple[object, ...]] = {
    "use_beam_search": (False,),
    "guided_whitespace_pattern": (),
    "structured_outputs": (),  # vLLM's newer spelling of the guided_* fields: send those
}
# Structured outputs: OpenAI's response_format types, vLLM's guided_* fields and the engine's kind of each.
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# OpenAI's rule for a json_schema's name.
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class FieldError(GatewayError):
    """A request refused because of one field; `param` names it in the OpenAI error object."""

    def __init__(self, status: Status, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True, slots=True)
class ParsedBody:
    """A validated completion or chat request; `model` is echoed back as the client wrote it."""

    model: str
    adapter: str | None
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    user: str | None
    n: int = 1  # choices
    cache_salt: str | None = None
    structured_field: str | None = None  # the field the structured output constraint came from, if any
    # OpenAI's echo (completions): the prompt's text, and with logprobs its tokens' entries, come first.
    echo: bool = False
    # vLLM's prompt_logprobs as the client asked (the engine may be asked for more: `sampling.prompt_logprobs`).
    prompt_logprobs: int | None = None


def parse_chat(data: object, base_name: str) -> ParsedBody:
    """Validate a /v1/chat/completions body."""
    body = body_object(data)
    messages = chat_messages(body)
    for name in ("tools", "functions"):
        _no_op(body, name, f"{name} are not supported", [])
    _no_op(body, "tool_choice", "tool_choice is not supported", "none")
    logprobs = flag(body, "logprobs")
    top = _logprobs_count(body, "top_logprobs")
    if top and not logprobs:  # 0 changes nothing, and vLLM accepts it alone
        raise field_error("top_logprobs needs logprobs to be true", "top_logprobs")
    # Both are checked; the newer max_completion_tokens wins when a client sends both.
    max_tokens = _int(body, "max_tokens", 1)
    newer = _int(body, "max_completion_tokens", 1)
    wanted = (top or 0) if logprobs else None
    # vLLM's chat echo repeats the last message when the reply has its role: not this (completions') echo.
    _no_op(body, "echo", "echo is not supported on chat completions", False)
    return _common(body, base_name, None, messages, max_tokens if newer is None else newer, wanted)


def parse_completion(data: object, base_name: str) -> ParsedBody:
    """Validate a /v1/completions body."""
    body = body_object(data)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise field_error("send exactly one prompt per request (batched prompts are not supported)", "prompt")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise field_error("prompt must be a string (token-id prompts are not supported)", "prompt")
    valid_text(prompt, "prompt")
    logprobs = _logprobs_count(body, "logprobs")
    echo = flag(body, "echo")
    _no_op(body, "suffix", "suffix is not supported", "")
    # vLLM V1 refuses best_of > 1 (it removed best_of: vllm-project/vllm#13361) and takes 1 as a no-op, which
    # clients such as LangChain send with any n.
    best_of = _int(body, "best_of", 1)
    if best_of not in (None, 1):
        raise field_error("best_of > 1 is not supported; use n for several choices", "best_of")
    # vLLM's: max_tokens 0 with echo scores the prompt alone (lm-evaluation-harness's loglikelihood requests).
    max_tokens = _int(body, "max_tokens", 0 if echo else 1)
    return _common(body, base_name, prompt, None, max_tokens, logprobs, echo)


def chat_messages(body: dict[str, Any]) -> tuple[ChatMessage, ...]:
    """A chat body's `messages`, validated."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise field_error("messages must be a non-empty array of {role, content} objects", "messages")
    return tuple(_message(item, i) for i, item in enumerate(raw))


def model_field(body: dict[str, Any], base_name: str) -> tuple[str, str | None]:
    """A body's `model` as the client wrote it, and the adapter it names (None for the base model)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise field_error("model is required: 'base', 'base:ADAPTER' or 'ADAPTER'", "model")
    return model, parse_model(model, base_name)


def parse_model(model: str, base_name: str) -> str | None:
    """ "base" (or the base model's name) -> None; "base:NAME" and "NAME" -> the adapter NAME."""
    if model in ("base", base_name):
        return None
    if model.startswith("base:"):
        adapter = model[len("base:") :]
        if not adapter:
            raise field_error("model 'base:' names no adapter; use 'base' or 'base:ADAPTER'", "model")
        return adapter
    return model


def _common(
    body: dict[str, Any],
    base_name: str,
    prompt: str | None,
    messages: tuple[ChatMessage, ...] | None,
    max_tokens: int | None,
    logprobs: int | None,
    echo: bool = False,
) -> ParsedBody:
    model, adapter = model_field(body, base_name)
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    stream = flag(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise field_error("stream_options must be an object", "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise field_error("stream_options.include_usage must be true or false", "stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise field_error("user must be a string", "user")
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and not (isinstance(cache_salt, str) and 0 < len(cache_salt) <= MAX_CACHE_SALT):
        raise field_error(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters", "cache_salt")
    # vLLM's sampling extensions, which vLLM clients send, that the engine has no knob for.
    for name, accepted in _VLLM_NO_OPS.items():
        _no_op(body, name, f"{name} is not supported (a vLLM extension)", *accepted)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    repetition_penalty = _number(body, "repetition_penalty", 0.0, _MAX_FLOAT32, above=True)
    min_tokens = _int(body, "min_tokens", 0, _MAX_MIN_TOKENS)
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise field_error(f"min_tokens must be at most max_tokens ({max_tokens}), got {min_tokens}", "min_tokens")
    structured_field, structured_kind, structured_spec = _structured_output(body)
    prompt_logprobs = _logprobs_count(body, "prompt_logprobs")
    if prompt_logprobs and stream:  # vLLM's refusal, in its words (0 asks for nothing a stream would carry)
        raise field_error("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    # The engine's count: the client's prompt_logprobs, echo's entries (as many top tokens as logprobs: vLLM's),
    # and none for echo with max_tokens 0, which needs the engine's prompt-only mode all the same.
    counts = [] if prompt_logprobs is None or stream else [prompt_logprobs]
    counts += [logprobs] if echo and logprobs is not None else []
    counts += [0] if echo and max_tokens == 0 else []
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(0, _int(body, "top_k", -1, _MAX_TOP_K) or 0),
        seed=_int(body, "seed", _MIN_SEED, _MAX_SEED),
        stop=_stop(body.get("stop")),
        logprobs=logprobs,
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_p=_number(body, "min_p", 0.0, 1.0) or 0.0,
        min_tokens=min_tokens or 0,
        ignore_eos=flag(body, "ignore_eos"),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
        include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
        structured_kind=structured_kind,
        structured_spec=structured_spec,
        prompt_logprobs=max(counts) if counts else None,
    )
    return ParsedBody(
        model=model,
        adapter=adapter,
        prompt=prompt,
        messages=messages,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        user=user,
        n=n,
        cache_salt=cache_salt,
        structured_field=structured_field,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
    )


def _structured_output(body: dict[str, Any]) -> tuple[str | None, str, str]:
    """The request's structured output constraint as (the field it came from, the engine's kind, its spec), or
    (None, "", ""); at most one of response_format (other than text) and vLLM's guided_* fields. Whether a schema,
    regex or grammar compiles is the engine's to say (it knows the vocabulary)."""
    found: list[tuple[str, str, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind, spec = _response_format(fmt)
        if kind:
            found.append(("response_format", kind, spec))
    for name, kind in _GUIDED.items():
        value = body.get(name)
        if value is not None:
            found.append((name, kind, _guided(name, value)))
    if len(found) > 1:  # vLLM's words
        names = ", ".join(name for name, _, _ in found)
        raise field_error(
            f"You can only use one kind of structured outputs constraint but multiple are specified: {names}",
            found[1][0],
        )
    return found[0] if found else (None, "", "")


def _response_format(fmt: object) -> tuple[str, str]:
    if not isinstance(fmt, dict) or fmt.get("type") not in _RESPONSE_FORMATS:
        raise field_error(
            f"response_format must be an object whose type is one of {', '.join(_RESPONSE_FORMATS)}", "response_format"
        )
    if fmt["type"] != "json_schema":
        return ("" if fmt["type"] == "text" else "json_object"), ""
    where = "response_format.json_schema"
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise field_error(f"{where} must be an object with a name and a schema", where)
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise field_error(f"{where}.name must be 1 to 64 letters, digits, underscores or dashes", f"{where}.name")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise field_error(f"{where}.schema must be a JSON schema (an object)", f"{where}.schema")
    for key, kind in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise field_error(
                f"{where}.{key} must be {'true or false' if kind is bool else 'a string'}", f"{where}.{key}"
            )
    return "json_schema", json.dumps(schema)


def _guided(name: str, value: object) -> str:
    """The engine's spec for one of vLLM's guided_* fields."""
    if name == "guided_json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                schema = None
        if not isinstance(schema, dict):
            raise field_error("guided_json must be a JSON schema: an object, or a string holding one", name)
        return json.dumps(schema)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise field_error("guided_choice must be a non-empty array of non-empty strings", name)
        return json.dumps([valid_text(c, name) for c in value])
    if not isinstance(value, str) or not value:
        raise field_error(f"{name} must be a non-empty string", name)
    return valid_text(value, name)


def body_object(data: object) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise field_error("request body must be a JSON object")
    return data


def _no_op(body: dict[str, Any], name: str, message: str, *accepted: object) -> None:
    """Refuse an unsupported field unless it is absent, null, or one of its no-op values (same JSON type)."""
    value = body.get(name)
    if value is not None and not any(type(value) is type(a) and value == a for a in accepted):
        raise field_error(message, name)


def _message(item: object, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(item, dict):
        raise field_error(f"{where} must be an object with role and content", where)
    role = item.get("role")
    # isinstance first: a list or object role is unhashable and would raise inside the set lookup.
    if not isinstance(role, str) or role not in _ROLES:
        raise field_error(f"{where}.role must be one of {', '.join(sorted(_ROLES))}, got {role!r}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise field_error(f"{where}.content: only text parts are supported", f"{where}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise field_error(f"{where}.content must be a string or an array of text parts", f"{where}.content")
    valid_text(content, f"{where}.content")
    # The chat template knows system, not the newer developer role; they mean the same here.
    return ChatMessage("system" if role == "developer" else str(role), content)


def _int(body: dict[str, Any], name: str, minimum: int | None, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise field_error(f"{name} must be an integer, got {type(value).__name__}", name)
    if minimum is not None and value < minimum:
        raise field_error(f"{name} must be at least {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise field_error(f"{name} must be at most {maximum}, got {value}", name)
    return value


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field; absent or null is `default`."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise field_error(f"{name} must be true or false", name)
    return value


def _logprobs_count(body: dict[str, Any], name: str) -> int | None:
    """A count of most likely tokens to return beside each sampled (or prompt) token: 0 to 20; above, refused in
    vLLM's words."""
    count = _int(body, name, 0)
    if count is not None and count > _MAX_LOGPROBS:
        kind = "prompt" if name == "prompt_logprobs" else "sample"
        raise field_error(
            f"Requested {kind} logprobs of {count}, which is greater than max allowed: {_MAX_LOGPROBS} "
            f"(parameter={name}, value={count})",
            name,
        )
    return count


def _number(body: dict[str, Any], name: str, low: float, high: float, *, above: bool = False) -> float | None:
    """A number within [low, high], or (`above`) within (low, high]; None when absent."""
    value = body.get(name)
    return None if value is None else _bounded(value, name, name, low, high, above=above)


def _bounded(value: object, name: str, param: str, low: float, high: float, *, above: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise field_error(f"{name} must be a number", param)
    # Only floats can be NaN or infinite; math.isfinite on a JSON integer beyond float range overflows.
    if isinstance(value, float) and not math.isfinite(value):
        raise field_error(f"{name} must be a number", param)
    if not (low < value <= high if above else low <= value <= high):
        bounds = f"greater than {low:g} and at most {high:g}" if above else f"between {low:g} and {high:g}"
        raise field_error(f"{name} must be {bounds}, got {value}", param)
    return float(value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's token id (a decimal string) -> bias object as (id, bias) pairs; ids past the vocabulary are the
    engine's to refuse (it knows the vocabulary)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise field_error("logit_bias must be an object mapping token ids to biases", "logit_bias")
    if len(value) > _MAX_LOGIT_BIAS:
        raise field_error(f"logit_bias may hold at most {_MAX_LOGIT_BIAS} token ids, got {len(value)}", "logit_bias")
    out = []
    for key, bias in value.items():
        if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key):
            raise field_error(
                f"logit_bias keys must be token ids (integers from 0 to 999999999), got {key!r}", "logit_bias"
            )
        out.append((int(key), _bounded(bias, f"logit_bias[{key!r}]", "logit_bias", -100.0, 100.0)))
    return tuple(out)


def _stop_token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if (
        not isinstance(value, list)
        or len(value) > _MAX_STOP_TOKEN_IDS
        or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value)
    ):
        raise field_error(
            f"stop_token_ids must be an array of at most {_MAX_STOP_TOKEN_IDS} token ids "
            f"(integers from 0 to {MAX_TOKEN_ID})",
            "stop_token_ids",
        )
    return tuple(value)


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (valid_text(value, "stop"),) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= _MAX_STOP:
        return tuple(valid_text(s, "stop") for s in value if s)
    raise field_error(f"stop must be a string or an array of at most {_MAX_STOP} strings", "stop")


def valid_text(value: str, param: str) -> str:
    # JSON escapes can spell a lone UTF-16 surrogate ("\ud800"), which no UTF-8 wire (the engine's gRPC
    # strings) can carry.
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise field_error(
                f"{param} contains an unpaired surrogate escape (not valid Unicode text)", param
            ) from None
    return value


def field_error(message: str, param: str | None = None) -> FieldError:
    return FieldError(Status.INVALID_ARGUMENT, message, param)
