"""The core's TokenService: the tenant, policy and registry checks a completion gets, then any replica taking
requests, the next where one fails as unavailable (the engine's own RPCs: tests/integration/engine/)."""

from __future__ import annotations

import grpc
import pytest

from bench.fast_engine import FastEngineFixture
from engine import engine_pb2 as pb
from gateway.api import ChatMessage, DetokenizeRequest, TokenizeRequest, Tokens
from gateway.errors import InvalidRequest, NotFound, PermissionDenied, Unavailable
from tests.conftest import free_port
from tests.unit.gateway.test_core import DenyLongPrompts, _gateway


class TokenizingEngine(FastEngineFixture):
    """One token per byte; `unavailable` answers as a stopping engine does."""

    unavailable = False

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        text = request.prompt if request.WhichOneof("input") == "prompt" else request.chat.messages[0].content
        strs = list(text) if request.return_token_strs else []
        return pb.TokenizeResponse(tokens=text.encode(), token_strs=strs, max_model_len=self.options.max_model_len)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        if any(t > 255 for t in request.tokens):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tokens[0] is outside the vocabulary [0, 256)")
        return pb.DetokenizeResponse(prompt=bytes(request.tokens).decode())


def _tokenize(tenant: str = "alice", adapter: str | None = None, prompt: str = "hi") -> TokenizeRequest:
    return TokenizeRequest(tenant, adapter, prompt, return_token_strs=True)


async def test_tokens_come_from_an_engine_for_the_base_model_and_adapters() -> None:
    async with TokenizingEngine() as engine, _gateway([engine]) as gateway:
        assert await gateway.tokenize(_tokenize()) == Tokens((104, 105), 2048, ("h", "i"))
        chat = TokenizeRequest("alice", "pirate", None, (ChatMessage("user", "yo"),))
        assert (await gateway.tokenize(chat)).ids == (121, 111)
        assert await gateway.detokenize(DetokenizeRequest("alice", "shout", (104, 105))) == "hi"


@pytest.mark.parametrize(
    ("tenant", "adapter", "error", "needle"),
    [
        ("alice", "nope", NotFound, "nope"),
        ("bob", "pirate", PermissionDenied, "may not use adapter 'pirate'"),  # bob's key allows shout alone
        ("bob", "shout", PermissionDenied, "may not use adapter 'shout'"),  # and shout's spec allows alice alone
    ],
)
async def test_refused_as_a_completion_is_before_any_engine(
    tenant: str, adapter: str, error: type[Exception], needle: str
) -> None:
    async with TokenizingEngine() as engine, _gateway([engine]) as gateway:
        with pytest.raises(error, match=needle):
            await gateway.tokenize(_tokenize(tenant, adapter))
        with pytest.raises(error, match=needle):
            await gateway.detokenize(DetokenizeRequest(tenant, adapter, (1,)))


async def test_the_policy_sees_the_prompt() -> None:
    async with TokenizingEngine() as engine, _gateway([engine], policy=DenyLongPrompts()) as gateway:
        with pytest.raises(PermissionDenied, match="prompt too long"):
            await gateway.tokenize(_tokenize(prompt="x" * 60))
        long_chat = TokenizeRequest("alice", None, None, (ChatMessage("user", "x" * 60),))
        with pytest.raises(PermissionDenied, match="prompt too long"):
            await gateway.tokenize(long_chat)


async def test_the_engines_refusal_is_the_clients_fault() -> None:
    async with TokenizingEngine() as engine, _gateway([engine]) as gateway:
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            await gateway.detokenize(DetokenizeRequest("alice", None, (300,)))


async def test_a_replica_failing_as_unavailable_hands_the_call_on() -> None:
    async with TokenizingEngine() as stopping, TokenizingEngine() as other, _gateway([stopping, other]) as gateway:
        gateway.pool.replicas[1].in_flight = 1  # the stopping one is the less loaded: asked first
        stopping.unavailable = True
        assert (await gateway.tokenize(_tokenize())).ids == (104, 105)
        # It still answers Stats: not marked down (which would cut its streams), as for a stream's refusal.
        assert gateway.pool.replicas[0].healthy
        other.unavailable = True
        with pytest.raises(Unavailable):
            await gateway.tokenize(_tokenize())


async def test_no_engine_is_unavailable() -> None:
    async with _gateway([free_port()]) as gateway:
        with pytest.raises(Unavailable, match="no engine replica is available"):
            await gateway.tokenize(_tokenize())
