"""vLLM's /tokenize and /detokenize on the engine replicas: the engine's tokenizer through its unary RPCs.

Every replica serves the same base model, so any one taking requests answers; these calls take no queue slot
(they are cheap, bounded by the body size, and generate nothing), and a replica that fails one as unavailable
hands it to the next.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from engine import engine_pb2 as pb
from engine import engine_pb2_grpc as pb_grpc
from gateway.api import DetokenizeRequest, TokenizeRequest, Tokens
from gateway.engine_client import EnginePool
from gateway.errors import GatewayError, InvalidRequest
from gateway.replica import ReplicaFailed, no_engine

_T = TypeVar("_T")


async def tokenize(pool: EnginePool, request: TokenizeRequest) -> Tokens:
    """`request` tokenized by one of `pool`'s replicas; raises `GatewayError`."""
    message = pb.TokenizeRequest(
        add_special_tokens=request.add_special_tokens,
        add_generation_prompt=request.add_generation_prompt,
        return_token_strs=request.return_token_strs,
    )
    if request.messages is not None:
        message.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.content) for m in request.messages)
    else:
        message.prompt = request.prompt or ""
    reply = await _on_any_replica(pool, lambda stub, timeout: stub.Tokenize(message, timeout=timeout))
    strs = tuple(reply.token_strs) if request.return_token_strs else None
    return Tokens(tuple(reply.tokens), reply.max_model_len, strs)


async def detokenize(pool: EnginePool, request: DetokenizeRequest) -> str:
    """The text of `request.ids` as one of `pool`'s replicas decodes them; raises `GatewayError`."""
    try:
        message = pb.DetokenizeRequest(tokens=request.ids)
    except ValueError as e:  # an id past uint32 (the REST layer bounds them before)
        raise InvalidRequest(f"tokens cannot be sent to the engine: {e}") from None
    reply = await _on_any_replica(pool, lambda stub, timeout: stub.Detokenize(message, timeout=timeout))
    return reply.prompt


async def _on_any_replica(pool: EnginePool, call: Callable[[pb_grpc.EngineStub, float], Awaitable[_T]]) -> _T:
    """`call` on the least loaded replica taking requests, then on the next where one fails as unavailable."""
    tried: set[str] = set()
    failed: GatewayError | None = None
    while True:
        ready = [r for r in pool.replicas if r.takes_requests and r.name not in tried]
        if not ready:
            raise failed or no_engine()
        replica = min(ready, key=lambda r: r.load)
        try:
            return await call(replica.stub, pool.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            failed = await pool.unary_error(replica, e)
            if not isinstance(failed, ReplicaFailed):
                raise failed from None
            tried.add(replica.name)
