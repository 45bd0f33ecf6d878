"""`python -m engine` (also `adaptergate engine`): run one engine process serving engine/engine.proto.

The step loop runs on the main thread (faster torch CPU kernels there); the gRPC server runs its asyncio
loop on a second thread and hands requests over through the engine's thread-safe calls.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from engine.config import EngineConfig


def build_parser(prog: str = "python -m engine") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port (see --ready-file)")
    parser.add_argument("--ready-file", type=Path, help='write {"port": N, "pid": P} here once serving')
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="register a PEFT adapter at start (repeatable)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, refuse new requests and finish those in flight for up to this long (a second SIGTERM "
        "or SIGINT stops at once)",
    )
    defaults = EngineConfig()
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if isinstance(default, bool):  # type=bool would read "--flag False" as True
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return parser


def config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


class GrpcThread:
    """The gRPC server on its own asyncio loop and thread."""

    def __init__(self, engine: Any, host: str, port: int) -> None:
        self._engine, self._host, self._port = engine, host, port
        self._loop = asyncio.new_event_loop()
        self._server: Any = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._main, name="grpc", daemon=True)

    def start(self) -> int:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self.port

    def stop(self, grace: float = 5.0) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result(timeout=grace + 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=grace + 5)

    def _main(self) -> None:
        from engine.server import serve

        asyncio.set_event_loop(self._loop)
        try:
            self._server, self.port = self._loop.run_until_complete(serve(self._engine, self._host, self._port))
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()


def main(argv: list[str] | None = None, prog: str = "python -m engine") -> None:
    """Run one engine process until SIGTERM/SIGINT; `prog` names the command in usage and errors."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format='{"ts": "%(asctime)s", "level": "%(levelname)s", "logger": "%(name)s", "msg": "%(message)s"}',
    )
    args = build_parser(prog).parse_args(argv)
    try:
        config_from(args).validate()
    except ValueError as exc:
        raise SystemExit(f"invalid engine configuration: {exc}") from exc
    if not 0 <= args.drain_timeout_s < float("inf"):
        raise SystemExit(f"invalid engine configuration: --drain-timeout-s must be >= 0, got {args.drain_timeout_s}")

    from engine.engine import LLMEngine
    from engine.errors import EngineError

    try:
        engine = LLMEngine(config_from(args))
    except (FileNotFoundError, ValueError) as exc:  # the model missing, unsupported or corrupt; no GPU memory
        raise SystemExit(f"cannot start the engine: {exc}") from exc
    for item in args.adapter:
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"--adapter expects NAME=PATH, got {item!r}")
        try:
            engine.load_adapter(name, path)
        except EngineError as exc:
            raise SystemExit(f"adapter {name!r}: {exc.message}") from exc
    grpc_thread = GrpcThread(engine, args.host, args.port)
    try:
        port = grpc_thread.start()
    except OSError as exc:
        engine.stop()  # its adapter loader processes and threads
        raise SystemExit(f"cannot start the engine: {exc}") from exc
    stopping = threading.Event()

    def on_signal(*_: object) -> None:
        # The first one drains: the gateway in front has stopped sending and waits for the streams in flight.
        if stopping.is_set():
            engine.request_stop()
        else:
            stopping.set()
            engine.request_drain(args.drain_timeout_s)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    logging.getLogger("engine").info("engine ready on %s:%d (model %s)", args.host, port, engine.model_name)
    if args.ready_file:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
        tmp.replace(args.ready_file)
    engine.run()  # until drained after SIGTERM / SIGINT
    grpc_thread.stop(grace=5)
    engine.stop()


if __name__ == "__main__":
    main()
