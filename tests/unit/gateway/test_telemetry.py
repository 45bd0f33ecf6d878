from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import propagate, trace

from gateway.telemetry import JsonFormatter


@pytest.fixture
def lines() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("adaptergate.test_telemetry")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger, stream
    logger.removeHandler(handler)


def _strict(stream: io.StringIO) -> list[dict[str, Any]]:
    """Each line as JSON that any parser accepts: one object per line, no NaN or Infinity."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def test_odd_characters_stay_inside_one_json_line(lines: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = lines
    odd = 'say "hi"\nsecond line\r\t\\ \x00 \u2028 \udcff'  # quotes, newlines, controls, a lone surrogate
    logger.info("got %s", odd, extra={"request_id": odd, "tenant": "alice", "raw": b"\xff\xfe"})
    try:
        raise ValueError(odd)
    except ValueError:
        logger.exception("failed", extra={"request_id": "r2", "tenant": "bob"})
    first, second = _strict(stream)
    assert first["msg"] == f"got {odd}" and first["request_id"] == odd and first["tenant"] == "alice"
    assert first["level"] == "info" and first["logger"] == "adaptergate.test_telemetry"
    assert first["raw"] == str(b"\xff\xfe")
    assert (second["request_id"], second["tenant"], second["level"]) == ("r2", "bob", "error")
    assert "ValueError" in second["exc"] and odd in second["exc"]


def test_values_json_cannot_write_do_not_break_the_line(lines: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = lines
    logger.info("slow", extra={"request_id": "r1", "tenant": "alice", "latency_ms": float("nan")})
    logger.info("odd", extra={"request_id": "r2", "tenant": "bob", "wait_s": float("inf"), "by": {("a", 1): 2}})
    first, second = _strict(stream)
    assert (first["msg"], first["request_id"], first["tenant"], first["latency_ms"]) == ("slow", "r1", "alice", "nan")
    assert (second["request_id"], second["tenant"], second["wait_s"]) == ("r2", "bob", "inf")
    assert second["by"] == str({("a", 1): 2})


def test_lines_carry_the_trace_id_of_the_callers_traceparent(lines: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = lines
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    context = propagate.extract({"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    with trace.use_span(trace.get_current_span(context)):
        logger.info("inside", extra={"request_id": "r1", "tenant": "alice"})
    logger.info("outside")
    inside, outside = _strict(stream)
    assert inside["trace_id"] == trace_id
    assert "trace_id" not in outside
