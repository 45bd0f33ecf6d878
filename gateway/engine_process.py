"""Engine child processes the gateway starts, supervises and stops itself.

The child follows the ready-file contract of `python -m engine`: started with `--port 0 --ready-file
PATH`, it writes {"port": N, "pid": P} to PATH once it serves. A child that dies while the gateway
runs is restarted (with a pause between attempts), and the pool is pointed at its new port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from gateway.config import LocalEngineConfig
from gateway.errors import Unavailable

log = logging.getLogger("adaptergate.engine_process")
_READY_POLL_S = 0.05
_RESTART_PAUSE_S = 2.0


def engine_command(config: LocalEngineConfig) -> list[str]:
    """The command line starting one engine (without the port and ready-file arguments)."""
    command = list(config.command) or [sys.executable, "-m", "engine"]
    command += ["--device", config.device]
    if config.max_num_seqs is not None:
        command += ["--max-num-seqs", str(config.max_num_seqs)]
    if config.max_model_len is not None:
        command += ["--max-model-len", str(config.max_model_len)]
    return command + list(config.extra_args)


class LocalEngine:
    """One engine child process; `start` returns its "host:port" once it serves."""

    def __init__(self, command: Sequence[str], *, name: str, start_timeout_s: float = 300.0) -> None:
        self.command = list(command)
        self.name = name
        self._start_timeout_s = start_timeout_s
        self._process: asyncio.subprocess.Process | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="adaptergate-engine-")
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> str:
        """Start the child and wait for its ready file; raises `Unavailable` if it exits or times out."""
        ready = Path(self._dir.name) / "ready.json"
        ready.unlink(missing_ok=True)
        argv = [*self.command, "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready)]
        log.info("starting engine", extra={"replica": self.name, "argv": argv})
        try:
            self._process = process = await asyncio.create_subprocess_exec(*argv, start_new_session=True)
        except OSError as e:  # engines.local.command names no runnable program
            raise Unavailable(f"engine {self.name}: cannot run {argv[0]!r}: {e.strerror or e}") from None
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._start_timeout_s
        while not ready.exists():
            if process.returncode is not None:
                raise Unavailable(f"engine {self.name} exited with status {process.returncode} while starting")
            if loop.time() > give_up:
                # Not `stop()`: that would end supervision too, and a restart that was slow once would be the last.
                await self._terminate(process)
                raise Unavailable(f"engine {self.name} not ready after {self._start_timeout_s:.0f}s")
            await asyncio.sleep(_READY_POLL_S)
        info = json.loads(ready.read_text())
        address = f"127.0.0.1:{int(info['port'])}"
        log.info("engine ready", extra={"replica": self.name, "address": address, "pid": process.pid})
        return address

    def supervise(self, on_restart: Callable[[str], None]) -> None:
        """Restart the child whenever it dies, calling `on_restart(new_address)` once it serves again."""
        self._supervisor = asyncio.create_task(self._supervise(on_restart), name=f"supervise-{self.name}")

    async def _supervise(self, on_restart: Callable[[str], None]) -> None:
        while not self._stopping and self._process is not None:
            code = await self._process.wait()
            if self._stopping:
                return
            log.error("engine exited unexpectedly; restarting", extra={"replica": self.name, "status": code})
            await asyncio.sleep(_RESTART_PAUSE_S)
            try:
                on_restart(await self.start())
            except Unavailable as e:
                log.error("engine restart failed: %s", e.message, extra={"replica": self.name})

    async def stop(self, timeout_s: float = 15.0) -> None:
        """Terminate the child (SIGTERM, then SIGKILL after `timeout_s`)."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        if self._process is not None:
            await self._terminate(self._process, timeout_s)
        self._dir.cleanup()

    async def _terminate(self, process: asyncio.subprocess.Process, timeout_s: float = 15.0) -> None:
        if process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            log.warning("engine did not stop in %.0fs; killing it", timeout_s, extra={"replica": self.name})
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
