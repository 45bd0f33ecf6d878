"""The engine's gRPC contract, served by a real engine process started on a free port."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine import engine_pb2 as pb
from engine import engine_pb2_grpc as pb_grpc
from tests.unit.engine.tiny import write_adapter


@contextlib.contextmanager
def _engine(tmp: Path) -> Iterator[tuple[pb_grpc.EngineStub, subprocess.Popen[bytes]]]:
    """A real engine process on a free port, and a stub for it."""
    ready = tmp / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "--port",
            "0",
            "--ready-file",
            str(ready),
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "256",
            "--max-num-batched-tokens",
            "512",
            "--max-lora-rank",
            "16",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "engine.log", "w"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, (tmp / "engine.log").read_text()
            assert time.monotonic() < deadline, "engine did not start"
            time.sleep(0.1)
        port = json.loads(ready.read_text())["port"]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        yield pb_grpc.EngineStub(channel), proc
        channel.close()
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[pb_grpc.EngineStub, Path]]:
    tmp = tmp_path_factory.mktemp("engine")
    with _engine(tmp) as (stub, _):
        yield stub, tmp


def chat_request(request_id: str, text: str, max_tokens: int = 16, adapter: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        adapter=adapter,
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingParams(max_tokens=max_tokens),
    )


def test_generate_streams_tokens_then_finish_and_usage(engine_process: tuple[pb_grpc.EngineStub, Path]) -> None:
    stub, _ = engine_process
    responses = list(stub.Generate(chat_request("g1", "What is the capital of France?", 20)))
    assert responses[0].admitted and responses[0].request_id == "g1"
    last = responses[-1]
    assert last.finish_reason in ("stop", "length")
    text = "".join(r.text for r in responses)
    assert "Paris" in text
    assert last.usage.completion_tokens == sum(len(r.token_ids) for r in responses)


def test_generate_sends_each_tokens_logprobs_when_asked(engine_process: tuple[pb_grpc.EngineStub, Path]) -> None:
    stub, _ = engine_process
    request = chat_request("lp1", "What is the capital of France?", 12)
    request.sampling.logprobs = 3
    responses = list(stub.Generate(request))[1:]
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    entries = [(t, e) for r in responses for t, e in zip(r.token_ids, r.logprobs, strict=True)]
    assert len(entries) == responses[-1].usage.completion_tokens
    raw = b""
    for token_id, entry in entries:
        assert entry.sampled.token_id == token_id and entry.sampled.token == entry.sampled.token_bytes.decode()
        assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
        assert len(entry.top) == 3 and entry.top[0] == entry.sampled  # greedy: the sampled token is the best
        raw += entry.sampled.token_bytes
    assert raw.decode() == "".join(r.text for r in responses)
    plain = list(stub.Generate(chat_request("lp2", "What is the capital of France?", 12)))
    assert not any(r.logprobs for r in plain)


@pytest.mark.parametrize(
    ("request_", "code", "needle"),
    [
        (chat_request("e1", "hi", adapter="missing"), grpc.StatusCode.NOT_FOUND, "missing"),
        (pb.GenerateRequest(request_id="e2"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (pb.GenerateRequest(request_id="e3", prompt="word " * 400), grpc.StatusCode.INVALID_ARGUMENT, "context"),
        # max_tokens past the context was cut short without a word (finish "length"); vLLM refuses it.
        (
            pb.GenerateRequest(request_id="e9", prompt="word " * 200, sampling=pb.SamplingParams(max_tokens=100)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "However, you requested",
        ),
        (
            pb.GenerateRequest(
                request_id="e4", chat=pb.ChatInput(messages=[pb.ChatMessage(role="wizard", content="x")])
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "role",
        ),
        (
            pb.GenerateRequest(request_id="e5", prompt="hi", sampling=pb.SamplingParams(top_p=1.5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        # Only 0 means "off": a negative or NaN top_p was taken as off too, and sampled from the whole vocabulary.
        (
            pb.GenerateRequest(request_id="e6", prompt="hi", sampling=pb.SamplingParams(top_p=-0.5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            pb.GenerateRequest(request_id="e7", prompt="hi", sampling=pb.SamplingParams(top_p=float("nan"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            pb.GenerateRequest(request_id="e8", prompt="hi", sampling=pb.SamplingParams(temperature=float("nan"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        (
            pb.GenerateRequest(request_id="e10", prompt="hi", sampling=pb.SamplingParams(logprobs=21)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "logprobs",
        ),
    ],
)
def test_bad_requests_get_precise_codes(
    engine_process: tuple[pb_grpc.EngineStub, Path], request_: pb.GenerateRequest, code: grpc.StatusCode, needle: str
) -> None:
    stub, _ = engine_process
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_))
    assert err.value.code() == code
    assert needle in err.value.details()


def test_deadline_stops_the_request_within_a_step(engine_process: tuple[pb_grpc.EngineStub, Path]) -> None:
    stub, _ = engine_process
    request = pb.GenerateRequest(
        request_id="slow", prompt="Once upon a time", sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True)
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = stub.Stats(pb.StatsRequest())
        if stats.running_requests == 0 and stats.waiting_requests == 0:
            break
        time.sleep(0.05)
    assert stats.running_requests == 0, "the cancelled request kept running"


def test_adapter_lifecycle(engine_process: tuple[pb_grpc.EngineStub, Path]) -> None:
    stub, tmp = engine_process
    from engine.config import ModelArch  # noqa: F401 - documents the shape the adapter is built for
    from engine.loader import load_weights, resolve_model

    arch, _ = load_weights(resolve_model("smollm2"))
    good = write_adapter(tmp / "good", arch=arch, rank=8, modules=("q_proj", "v_proj"), seed=3)
    before = stub.Stats(pb.StatsRequest()).adapter_cache
    info = stub.LoadAdapter(pb.LoadAdapterRequest(name="good", path=str(good), wait=True)).adapter
    assert (info.name, info.rank, info.state) == ("good", 8, "host")
    assert sorted(info.target_modules) == ["q_proj", "v_proj"]
    base = "".join(r.text for r in stub.Generate(chat_request("b", "Tell me a fact.", 12)))
    tuned = "".join(r.text for r in stub.Generate(chat_request("t", "Tell me a fact.", 12, adapter="good")))
    assert tuned != base  # random LoRA weights of this size change greedy output
    listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert listed["good"].state == "resident" and listed["good"].requests_served == 1
    after = stub.Stats(pb.StatsRequest()).adapter_cache  # one read from disk, one copy into a slot
    assert (after.loads - before.loads, after.slot_misses - before.slot_misses) == (1, 1)
    assert after.slot_hits == before.slot_hits
    assert stub.UnloadAdapter(pb.UnloadAdapterRequest(name="good")).found
    with pytest.raises(grpc.RpcError) as gone:
        list(stub.Generate(chat_request("g", "hi", adapter="good")))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_malformed_adapter_is_refused_and_engine_keeps_serving(engine_process: tuple[pb_grpc.EngineStub, Path]) -> None:
    stub, tmp = engine_process
    bad = write_adapter(tmp / "bad", rank=4)  # tiny-model shapes: wrong base
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadAdapter(pb.LoadAdapterRequest(name="bad", path=str(bad)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "wrong base model" in err.value.details()
    assert list(stub.Generate(chat_request("after", "hi", 4)))[-1].finish_reason in ("stop", "length")


def test_sigterm_drains_the_streams_in_flight(tmp_path: Path) -> None:
    # SIGTERM once stopped the step loop at once: the streams in flight were cut (CANCELLED after the
    # server's grace period). Now new requests are refused while those in flight run to their end.
    with _engine(tmp_path) as (stub, proc):
        request = chat_request("s1", "Count from one to one hundred, one number per line.", 40)
        request.sampling.ignore_eos = True
        stream = stub.Generate(request)
        assert next(stream).admitted
        assert len(next(stream).token_ids) > 0  # a first token: the request is decoding
        assert not stub.Stats(pb.StatsRequest()).draining
        proc.send_signal(signal.SIGTERM)
        # Until the handler has run, a short request is still served; then it is refused by the draining
        # engine itself ("shutting down"), not by a process that has already exited.
        deadline = time.monotonic() + 10
        for attempt in itertools.count():
            try:
                list(stub.Generate(chat_request(f"s2-{attempt}", "Hi", 4)))
            except grpc.RpcError as e:
                refused = e
                break
            assert time.monotonic() < deadline, "SIGTERM did not start a drain"
            time.sleep(0.05)
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
        # Stats once still read as a healthy engine: the gateway went on routing new requests here to bounce.
        assert stub.Stats(pb.StatsRequest()).draining
        rest = list(stream)
        assert rest[-1].finish_reason == "length" and rest[-1].usage.completion_tokens == 40
        assert proc.wait(timeout=30) == 0
