"""The engine's Tokenize and Detokenize RPCs, served by a real engine process (SmolLM2): the tokens Generate
would read, and back."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from engine import engine_pb2 as pb
from engine import engine_pb2_grpc as pb_grpc
from tests.integration.engine.test_server import _engine, chat_request

PROMPT = "The sea is vast, 深い海 🌊 and full of life."


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pb_grpc.EngineStub]:
    with _engine(tmp_path_factory.mktemp("engine")) as (engine_stub, _):
        yield engine_stub


def _chat(*turns: tuple[str, str]) -> pb.ChatInput:
    return pb.ChatInput(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])


def _prompt_tokens(stub: pb_grpc.EngineStub, request: pb.GenerateRequest) -> int:
    request.sampling.max_tokens = 1
    return list(stub.Generate(request))[-1].usage.prompt_tokens


def test_a_prompt_tokenizes_as_generate_reads_it_and_back(stub: pb_grpc.EngineStub) -> None:
    reply = stub.Tokenize(pb.TokenizeRequest(prompt=PROMPT, add_special_tokens=True, return_token_strs=True))
    assert len(reply.tokens) == _prompt_tokens(stub, pb.GenerateRequest(request_id="t1", prompt=PROMPT))
    assert reply.max_model_len == 256
    assert len(reply.token_strs) == len(reply.tokens) and reply.token_strs[1] == "Ġsea"  # the vocabulary's spelling
    assert stub.Detokenize(pb.DetokenizeRequest(tokens=reply.tokens)).prompt == PROMPT
    assert not stub.Tokenize(pb.TokenizeRequest(prompt=PROMPT)).token_strs


def test_a_chat_tokenizes_as_generate_reads_it(stub: pb_grpc.EngineStub) -> None:
    chat = _chat(("system", "Be brief."), ("user", "What is the capital of France?"))
    reply = stub.Tokenize(pb.TokenizeRequest(chat=chat, add_generation_prompt=True))
    assert len(reply.tokens) == _prompt_tokens(stub, pb.GenerateRequest(request_id="t2", chat=chat))
    text = stub.Detokenize(pb.DetokenizeRequest(tokens=reply.tokens)).prompt
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")  # special tokens kept, as vLLM's
    assert text.endswith("<|im_start|>assistant\n")
    closed = stub.Tokenize(pb.TokenizeRequest(chat=chat, add_generation_prompt=False))
    assert list(reply.tokens[: len(closed.tokens)]) == list(closed.tokens) and len(closed.tokens) < len(reply.tokens)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda s: s.Tokenize(pb.TokenizeRequest()), "one of prompt or chat"),
        (lambda s: s.Tokenize(pb.TokenizeRequest(chat=_chat())), "no messages"),
        (lambda s: s.Tokenize(pb.TokenizeRequest(chat=_chat(("wizard", "x")))), "role"),
        (lambda s: s.Detokenize(pb.DetokenizeRequest(tokens=[1, 49152])), "tokens[1] is 49152, outside the vocab"),
    ],
)
def test_bad_requests_are_invalid_arguments(stub: pb_grpc.EngineStub, call: object, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call(stub)  # type: ignore[operator]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (refused.value.details() or "")
    assert stub.Detokenize(pb.DetokenizeRequest(tokens=[504])).prompt == "The"  # still serving


def test_a_prompt_past_the_context_tokenizes_while_a_stream_runs(stub: pb_grpc.EngineStub) -> None:
    stream = stub.Generate(chat_request("t3", "Count to ten.", 24))
    first = next(stream)
    assert first.admitted
    long_prompt = "word " * 20_000  # past the context: tokenizing it is fine, generating it would not be
    assert len(stub.Tokenize(pb.TokenizeRequest(prompt=long_prompt)).tokens) > 256
    assert list(stream)[-1].finish_reason in ("stop", "length")
