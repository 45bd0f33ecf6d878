"""Process-wide logging and tracing set-up: structured JSON log lines and the OpenTelemetry tracer.

Log records may carry `extra={...}` fields (request_id, tenant, replica, ...); the JSON formatter
writes them as top-level keys, with the current trace id when a span is active.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, extras, trace id, exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            out["trace_id"] = f"{context.trace_id:032x}"
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        try:
            return json.dumps(out, default=str, allow_nan=False)
        except (TypeError, ValueError):
            # NaN or infinity (not JSON), keys json cannot write: such fields go as text, not as a line that
            # log parsers refuse or a logging error instead of the line.
            return json.dumps({key: _writable(value) for key, value in out.items()}, default=str)


def _writable(value: Any) -> Any:
    try:
        json.dumps(value, default=str, allow_nan=False)
    except (TypeError, ValueError):
        return str(value)
    return value


def setup_logging(level: str, fmt: str) -> None:
    """Route every `adaptergate.*` (and root) log line to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log would duplicate ours, in another format.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def setup_tracing(mode: str) -> None:
    """Install the SDK tracer provider: "sdk" records spans without exporting, "console" prints them."""
    if mode == "off":
        return
    provider = TracerProvider(resource=Resource.create({"service.name": "adaptergate"}))
    if mode == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
