"""FastEngineFixture: a deterministic stand-in for the engine, for tests and gateway benchmarks only.

It speaks the real `engine/engine.proto` service but runs no model: every request streams a fixed number
of chunks of fixed text, so the gateway's own cost can be measured without the engine dominating. It is
never a default anywhere; a config or a test has to name it explicitly. Requests that ask for logprobs get
made-up ones (`fixture_logprobs`).

    python bench/fast_engine.py --port 0 --ready-file P [--chunks 16] [--delay-ms 0]

writes {"port": N, "pid": P} to P once serving, like `python -m engine`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc

if __package__ in (None, ""):
    # Run as a script: make the repository root importable for the generated stubs.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import engine_pb2 as pb
from engine import engine_pb2_grpc as pb_grpc

FIXTURE_MODEL = "fast-engine-fixture"


@dataclass(frozen=True, slots=True)
class FastEngineOptions:
    """What every request gets: `chunks` messages of `chunk_text` (one token each), `delay_s` apart."""

    chunks: int = 16
    chunk_text: str = "tok "
    delay_s: float = 0.0
    max_model_len: int = 2048
    # Seconds an adapter stays "loading" after LoadAdapter, to exercise cold starts.
    load_delay_s: float = 0.0


def fixture_logprobs(text: str, index: int, top: int) -> pb.TokenLogprobs:
    """Made-up log-probabilities of the `index`-th token `text`: it is the most likely, at -0.25, and "alt1",
    "alt2", ... follow at -1, -2, ... (every value exact in float32)."""
    sampled = pb.TokenLogprob(token_id=index, token=text, token_bytes=text.encode(), logprob=-0.25)
    others = [
        pb.TokenLogprob(token_id=1000 + k, token=f"alt{k}", token_bytes=f"alt{k}".encode(), logprob=-float(k))
        for k in range(1, top)
    ]
    return pb.TokenLogprobs(sampled=sampled, top=[sampled, *others][:top])


def count_prompt_tokens(request: pb.GenerateRequest) -> int:
    """A deterministic stand-in for tokenization: about four characters per token."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return max(1, len(request.prompt) // 4)
    if kind == "chat":
        return sum(4 + len(m.content) // 4 for m in request.chat.messages)
    if kind == "prompt_token_ids":
        return len(request.prompt_token_ids.ids)
    return 0


class FastEngineFixture(pb_grpc.EngineServicer):
    """The engine gRPC service without a model; usable in-process (`async with`) or as a script."""

    def __init__(self, options: FastEngineOptions | None = None) -> None:
        self.options = options or FastEngineOptions()
        self.adapters: dict[str, pb.AdapterInfo] = {}
        self.active: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.load_calls: list[pb.LoadAdapterRequest] = []
        self.unload_calls: list[str] = []
        self.requests_seen: list[pb.GenerateRequest] = []
        self.record_requests = False
        self.tokens_generated = 0
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._loading: set[asyncio.Task[None]] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on `host:port` (0 = any free port) and return the bound port."""
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_EngineServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        await self._server.start()
        return self.port

    async def stop(self, grace: float | None = 0.5) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        for task in self._loading:
            task.cancel()

    async def __aenter__(self) -> FastEngineFixture:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.record_requests:
            self.requests_seen.append(request)
        if request.adapter and request.adapter not in self.adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown adapter {request.adapter!r}")
        prompt_tokens = count_prompt_tokens(request)
        if prompt_tokens > self.options.max_model_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt is {prompt_tokens} tokens, more than max_model_len {self.options.max_model_len}",
            )
        rid = request.request_id
        abort = asyncio.Event()
        self.active[rid] = abort
        try:
            yield pb.GenerateResponse(request_id=rid, admitted=True)
            limit = request.sampling.max_tokens
            n = self.options.chunks if limit == 0 else min(limit, self.options.chunks)
            finish = "length" if limit and limit < self.options.chunks else "stop"
            text, delay = self.options.chunk_text, self.options.delay_s
            top = request.sampling.logprobs if request.sampling.HasField("logprobs") else None
            produced = 0
            for i in range(n):
                if delay > 0:
                    await asyncio.sleep(delay)
                if abort.is_set():
                    finish = "abort"
                    break
                produced += 1
                if i == n - 1:
                    break
                logprobs = () if top is None else (fixture_logprobs(text, i, top),)
                yield pb.GenerateResponse(request_id=rid, text=text, token_ids=(i,), logprobs=logprobs)
            self.tokens_generated += produced
            info = self.adapters.get(request.adapter)
            if info is not None:
                info.requests_served += 1
                info.tokens_generated += produced
            # The last token rides on the final message, as a real engine may do.
            last = finish != "abort" and n > 0
            yield pb.GenerateResponse(
                request_id=rid,
                text=text if last else "",
                token_ids=(n - 1,) if last else (),
                logprobs=(fixture_logprobs(text, n - 1, top),) if last and top is not None else (),
                finish_reason=finish,
                usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=produced),
            )
        finally:
            self.active.pop(rid, None)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        event = self.active.get(request.request_id)
        self.aborted.append(request.request_id)
        if event is not None:
            event.set()
        return pb.AbortResponse(found=event is not None)

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        self.load_calls.append(request)
        if not request.name or not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and path are required")
        loading = self.options.load_delay_s > 0
        info = pb.AdapterInfo(
            name=request.name,
            path=request.path,
            rank=8,
            scaling=2.0,
            state="loading" if loading else "resident",
            pinned=request.pin,
        )
        self.adapters[request.name] = info
        if loading:
            task = asyncio.create_task(self._finish_loading(request.name))
            self._loading.add(task)
            task.add_done_callback(self._loading.discard)
            if request.wait:
                await task
        return pb.LoadAdapterResponse(adapter=info)

    async def _finish_loading(self, name: str) -> None:
        await asyncio.sleep(self.options.load_delay_s)
        if name in self.adapters:
            self.adapters[name].state = "resident"

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        self.unload_calls.append(request.name)
        return pb.UnloadAdapterResponse(found=self.adapters.pop(request.name, None) is not None)

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(adapters=list(self.adapters.values()))

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(
            running_requests=len(self.active),
            adapters=list(self.adapters.values()),
            model=FIXTURE_MODEL,
            max_model_len=self.options.max_model_len,
            tokens_generated=self.tokens_generated,
        )


def write_ready_file(path: str, port: int) -> None:
    """Atomically write the ready-file contract {"port": N, "pid": P}."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"port": port, "pid": os.getpid()}, f)
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace) -> None:
    fixture = FastEngineFixture(
        FastEngineOptions(
            chunks=args.chunks,
            chunk_text=args.chunk_text,
            delay_s=args.delay_ms / 1000,
            max_model_len=args.max_model_len,
            load_delay_s=args.load_delay_ms / 1000,
        )
    )
    for spec in args.adapter:
        name, _, path = spec.partition("=")
        fixture.adapters[name] = pb.AdapterInfo(name=name, path=path, rank=8, scaling=2.0, state="resident")
    port = await fixture.start(args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.ready_file:
        write_ready_file(args.ready_file, port)
    await stop.wait()
    await fixture.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", default="")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-text", default="tok ")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--load-delay-ms", type=float, default=0.0)
    parser.add_argument("--adapter", action="append", default=[], help="NAME=PATH, registered at start")
    # Accepted and ignored so the fixture can stand in for `python -m engine` command lines.
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-seqs", type=int, default=0)
    asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
