"""Runs the engine worker as a child process of ``tokenfan serve`` and restarts it if it dies.

The child gets its own session (a terminal's Ctrl-C reaches only the gateway, which then stops
the engine in order) and, on Linux, a parent-death signal, so a killed gateway never leaves an
orphaned engine holding the model in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator

log = logging.getLogger(__name__)


def _child_setup() -> None:  # runs in the child between fork and exec
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EngineSupervisor:
    """Start, watch and restart (with exponential backoff) one engine worker process."""

    def __init__(self, argv: list[str], *, backoff_initial: float = 1.0, backoff_max: float = 30.0,
                 stop_timeout: float = 15.0) -> None:
        self.argv = argv
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stop_timeout = stop_timeout
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    async def _spawn(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine_worker", *self.argv, preexec_fn=_child_setup)
        log.info("engine worker started (pid %d)", self.proc.pid)

    async def _watch(self) -> None:
        backoff = self.backoff_initial
        while not self._stopping:
            started = time.monotonic()
            await self._spawn()
            assert self.proc is not None
            code = await self.proc.wait()
            if self._stopping:
                return
            if time.monotonic() - started > 60:
                backoff = self.backoff_initial  # it ran fine for a while: start the backoff over
            self.restarts += 1
            log.error("engine worker exited with %s; restarting in %.1fs (restart #%d)", code, backoff, self.restarts)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.backoff_max)

    async def stop(self) -> None:
        self._stopping = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that lands as the exit does
                async with asyncio.timeout(self.stop_timeout):
                    await proc.wait()
            except TimeoutError:
                log.warning("engine worker did not stop within %.0fs: killing it", self.stop_timeout)
                proc.kill()
                await proc.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        log.info("engine worker stopped")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EngineSupervisor]:
        self._task = asyncio.create_task(self._watch(), name="engine-supervisor")
        try:
            yield self
        finally:
            await self.stop()
