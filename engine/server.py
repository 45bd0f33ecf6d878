"""The engine's gRPC service (engine/engine.proto) over one `LLMEngine`.

Handlers run on the asyncio loop; the engine runs on its own thread and hands outputs back through
`loop.call_soon_threadsafe`. A cancelled or timed-out call aborts its request, so its work stops within
one engine step.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from engine import engine_pb2 as pb
from engine import engine_pb2_grpc as pb_grpc
from engine.engine import LLMEngine
from engine.errors import EngineError, prompt_too_long
from engine.logprobs import PromptLogprob, TokenLogprobs
from engine.pool import AdapterVersion
from engine.sampling import STRUCTURED_KINDS, SamplingParams
from engine.sequence import RequestOutput
from engine.tokenizer import Tokenizer

log = logging.getLogger("engine.server")


def adapter_info(version: AdapterVersion) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        name=version.name,
        path=str(version.spec.path),
        rank=version.spec.rank,
        scaling=version.spec.scaling,
        target_modules=sorted(version.spec.modules),
        state=version.state.value,
        pinned=version.pinned,
        requests_served=version.requests_served,
        tokens_generated=version.tokens_generated,
        active_requests=version.active,
    )


class EngineService(pb_grpc.EngineServicer):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        engine = self.engine
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt_ids = self._prompt_ids(request)
            params = self._sampling(request.sampling, len(prompt_ids))
        except EngineError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
            return
        if params.structured_kind in STRUCTURED_KINDS:
            # Compiling a large schema takes a while: off the event loop, into the cache `add_request` reads.
            try:
                await asyncio.to_thread(engine.structured.compile, params.structured_kind, params.structured_spec)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        try:
            engine.add_request(
                request_id, prompt_ids, params, request.adapter or None, sink, request.priority, request.cache_salt
            )
        except EngineError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
            return
        finished = False
        try:
            yield pb.GenerateResponse(request_id=request_id, admitted=True)
            while True:
                out = await outputs.get()
                if out.error is not None:
                    finished = True
                    await context.abort(grpc.StatusCode.INTERNAL, out.error)
                    return
                usage = None
                if out.finish_reason is not None:
                    finished = True
                    usage = pb.Usage(
                        prompt_tokens=out.prompt_tokens,
                        completion_tokens=out.completion_tokens,
                        cached_tokens=out.cached_tokens,
                    )
                yield pb.GenerateResponse(
                    request_id=request_id,
                    text=out.text,
                    token_ids=out.token_ids,
                    finish_reason=out.finish_reason or "",
                    usage=usage,
                    logprobs=self._logprobs(out) if out.logprobs else (),
                    prompt_logprobs=self._prompt_logprobs(prompt_ids, out),
                )
                if finished:
                    return
        finally:
            if not finished:  # client cancelled, deadline passed, or the stream broke
                engine.abort(request_id)

    def _entry(self, token_id: int, logprob: float) -> pb.TokenLogprob:
        """A token with its log-probability, its text and bytes."""
        text, raw = self.engine.tokenizer.piece(token_id)
        return pb.TokenLogprob(token_id=token_id, token=text, token_bytes=raw, logprob=logprob)

    def _token_logprobs(self, token_id: int, lp: TokenLogprobs | PromptLogprob) -> pb.TokenLogprobs:
        """A token's log-probability and the most likely tokens at its position, each with its text and bytes."""
        return pb.TokenLogprobs(sampled=self._entry(token_id, lp.logprob), top=[self._entry(i, v) for i, v in lp.top])

    def _logprobs(self, out: RequestOutput) -> list[pb.TokenLogprobs]:
        """The wire form of `out.logprobs`."""
        return [self._token_logprobs(t, lp) for t, lp in zip(out.token_ids, out.logprobs, strict=True)]

    def _prompt_logprobs(self, prompt_ids: list[int], out: RequestOutput) -> pb.PromptLogprobs | None:
        """The wire form of `out.prompt_logprobs` (None where the output has none)."""
        if out.prompt_logprobs is None:
            return None
        rest = [self._token_logprobs(t, lp) for t, lp in zip(prompt_ids[1:], out.prompt_logprobs, strict=True)]
        ranks = [lp.rank for lp in out.prompt_logprobs]
        return pb.PromptLogprobs(first=self._entry(prompt_ids[0], 0.0), rest=rest, ranks=ranks)

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise EngineError("INVALID_ARGUMENT", "prompt is empty")
            return tokenizer.encode(request.prompt)
        if kind == "chat":
            return _encode_chat(tokenizer, request.chat)
        if kind == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        raise EngineError("INVALID_ARGUMENT", "one of prompt, chat or prompt_token_ids is required")

    def _sampling(self, s: pb.SamplingParams, prompt_len: int) -> SamplingParams:
        limit = self.engine.max_model_len
        room = limit - prompt_len
        if room <= 0:
            raise prompt_too_long(prompt_len, limit)
        if s.max_tokens > room:  # asked for: refused, as vLLM does (and in its words), not cut short silently
            raise EngineError(
                "INVALID_ARGUMENT",
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + s.max_tokens} tokens ({prompt_len} in the prompt, {s.max_tokens} in the "
                "completion). Shorten the prompt or lower max_tokens.",
            )
        wanted = s.max_tokens or self.engine.config.default_max_tokens  # 0: unset, the default within the room
        prompt_logprobs = s.prompt_logprobs if s.HasField("prompt_logprobs") else None
        if s.prompt_only and (s.max_tokens or prompt_logprobs is None):
            raise EngineError("INVALID_ARGUMENT", "prompt_only needs prompt_logprobs set and max_tokens 0")
        return SamplingParams(
            max_tokens=0 if s.prompt_only else min(wanted, room),
            prompt_logprobs=prompt_logprobs,
            temperature=s.temperature,
            top_p=1.0 if s.top_p == 0 else s.top_p,  # 0 means off; a negative or NaN one is refused
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            stop=tuple(s.stop),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs if s.HasField("logprobs") else None,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            logit_bias=tuple(sorted(s.logit_bias.items())),
            min_p=s.min_p,
            min_tokens=s.min_tokens,
            stop_token_ids=tuple(s.stop_token_ids),
            include_stop_str_in_output=s.include_stop_str_in_output,
            structured_kind=s.structured_kind,
            structured_spec=s.structured_spec,
        )

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        try:
            # Validation reads files and `wait` blocks on the load: keep both off the event loop.
            version = await asyncio.to_thread(
                self.engine.load_adapter, request.name, request.path, request.pin, request.wait
            )
        except EngineError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
            raise AssertionError("unreachable") from exc
        return pb.LoadAdapterResponse(adapter=adapter_info(version))

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        return pb.UnloadAdapterResponse(found=self.engine.unload_adapter(request.name))

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(adapters=[adapter_info(v) for v in self.engine.pool.versions()])

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        e = self.engine
        s = e.stats()
        return pb.StatsResponse(
            running_requests=s.running,
            waiting_requests=s.waiting,
            kv_blocks_total=s.kv_slots_total,
            kv_blocks_used=s.kv_slots_used,
            adapters=[adapter_info(v) for v in e.pool.versions()],
            model=e.model_name,
            max_model_len=e.max_model_len,
            lora_slots=e.config.lora_slots,
            steps=s.steps,
            tokens_generated=s.tokens_generated,
            adapter_cache=pb.AdapterCacheStats(
                slot_hits=s.adapter_cache.slot_hits,
                slot_misses=s.adapter_cache.slot_misses,
                evictions=s.adapter_cache.evictions,
                loads=s.adapter_cache.loads,
                fills_ahead=s.adapter_cache.fills_ahead,
            ),
            draining=e.draining,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
        )

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        tokenizer = self.engine.tokenizer
        kind = request.WhichOneof("input")
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one of prompt or chat is required")
        try:
            # A long prompt or chat template takes a while to encode: off the event loop, as Generate's streams
            # and the other calls are served from it.
            if kind == "chat":
                ids = await asyncio.to_thread(
                    _encode_chat,
                    tokenizer,
                    request.chat,
                    add_generation_prompt=request.add_generation_prompt,
                    add_special_tokens=request.add_special_tokens,
                )
            else:
                ids = await asyncio.to_thread(
                    tokenizer.encode, request.prompt, add_special_tokens=request.add_special_tokens
                )
        except EngineError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
            raise AssertionError("unreachable") from exc
        strs = tokenizer.token_strs(ids) if request.return_token_strs else ()
        return pb.TokenizeResponse(tokens=ids, token_strs=strs, max_model_len=self.engine.max_model_len)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        tokenizer = self.engine.tokenizer
        ids = list(request.tokens)
        # The tokenizer's vocabulary, not the LM head's (which may be padded past it): those ids have no text.
        bad = next((i for i, t in enumerate(ids) if t >= tokenizer.vocab_size), None)
        if bad is not None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tokens[{bad}] is {ids[bad]}, outside the vocabulary [0, {tokenizer.vocab_size})",
            )
        # Special tokens stay, as vLLM's /detokenize keeps them: a tokenized chat reads back as its template wrote it.
        text = await asyncio.to_thread(tokenizer.decode, ids, skip_special_tokens=False)
        return pb.DetokenizeResponse(prompt=text)


def _encode_chat(
    tokenizer: Tokenizer, chat: pb.ChatInput, *, add_generation_prompt: bool = True, add_special_tokens: bool = False
) -> list[int]:
    """Token ids of a chat as the model's template renders it (by default as Generate reads it); raises
    EngineError for no messages, an unknown role or a chat the template refuses."""
    messages = [(m.role, m.content) for m in chat.messages]
    if not messages:
        raise EngineError("INVALID_ARGUMENT", "chat has no messages")
    bad = [m[0] for m in messages if m[0] not in ("system", "user", "assistant")]
    if bad:
        raise EngineError("INVALID_ARGUMENT", f"unknown chat role {bad[0]!r} (system, user, assistant)")
    try:
        return tokenizer.encode_chat(
            messages, add_generation_prompt=add_generation_prompt, add_special_tokens=add_special_tokens
        )
    except ValueError as exc:
        raise EngineError("INVALID_ARGUMENT", str(exc)) from exc


async def serve(engine: LLMEngine, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server; returns it and the bound port (useful with port 0)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_EngineServicer_to_server(EngineService(engine), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises where it once returned 0, with a text about GRPC_VERBOSITY
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (the port is in use, or the host is not this machine's)")
    await server.start()
    return server, bound
