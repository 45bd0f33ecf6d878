"""`python -m engine` (also `adaptergate engine`): run one engine process serving engine/engine.proto."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

from engine.config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
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
    defaults = EngineConfig()
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(getattr(defaults, field.name)), default=getattr(defaults, field.name))
    return parser


async def run(args: argparse.Namespace) -> None:
    from engine.engine import EngineError, LLMEngine
    from engine.server import serve

    config = EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
    engine = LLMEngine(config)
    for item in args.adapter:
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"--adapter expects NAME=PATH, got {item!r}")
        try:
            engine.load_adapter(name, path)
        except EngineError as exc:
            raise SystemExit(f"adapter {name!r}: {exc.message}") from exc
    engine.start()
    server, port = await serve(engine, args.host, args.port)
    logging.getLogger("engine").info("engine ready on %s:%d (model %s)", args.host, port, engine.model_name)
    if args.ready_file:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
        tmp.replace(args.ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=5)
    engine.stop()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format='{"ts": "%(asctime)s", "level": "%(levelname)s", "logger": "%(name)s", "msg": "%(message)s"}',
    )
    args = build_parser().parse_args(argv)
    try:
        EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}).validate()
    except ValueError as exc:
        raise SystemExit(f"invalid engine configuration: {exc}") from exc
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
