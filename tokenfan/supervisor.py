"""Child processes of ``tokenfan serve`` / ``tokenfan gateway --workers N``, each restarted if it dies.

- :class:`ChildSupervisor` starts, watches and restarts (exponential backoff) one child: the engine worker of
  ``tokenfan serve``, or one gateway worker.
- :func:`run_workers` is the top process of a ``--workers N`` server: it serves nothing itself, it runs the
  engine (``serve``) and the N gateway workers as siblings, so the death of any worker stops neither the
  engine nor the other workers (the engine has no gateway for a parent). A killed worker is started again
  with the same index; its listed streams are adopted by a sibling meanwhile (``--broker``, docs/failures.md).
  SIGTERM/SIGINT stops the workers first (each drains, ``--shutdown-grace``), then the engine; SIGHUP is
  forwarded to every worker (each reloads its keys, token secrets and certificates). The workers share one
  stream-token secret (:func:`worker_secrets`), handed over with the API keys in their environment. A worker whose
  first start fails at once (the port is taken, a bad setting) is not restarted: the server stops, with its code.

Every child gets its own session (a terminal's Ctrl-C reaches only this process, which then stops the
children in order) and, on Linux, a parent-death signal, so a killed supervisor never leaves an orphaned
engine holding the model in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

log = logging.getLogger(__name__)

FAILED_START_S = 10.0  # a worker that exits with an error this soon after its first start is not restarted


def _child_setup() -> None:  # runs in the child between fork and exec
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ChildSupervisor:
    """Start, watch and restart (with exponential backoff) one child process: ``python <argv>``."""

    def __init__(self, argv: list[str], *, name: str = "engine worker", env: dict[str, str] | None = None,
                 backoff_initial: float = 1.0, backoff_max: float = 30.0, stop_timeout: float = 15.0,
                 on_failed_start: Callable[[int], None] | None = None) -> None:
        self.argv, self.name, self.env = argv, name, env
        # called (and no restart) if the first start exits with an error within FAILED_START_S: a setting or
        # the port is wrong, and restarting would only repeat it
        self.on_failed_start = on_failed_start
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stop_timeout = stop_timeout
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    async def _spawn(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(sys.executable, *self.argv, env=self.env,
                                                         preexec_fn=_child_setup)
        log.info("%s started (pid %d)", self.name, self.proc.pid)

    async def _watch(self) -> None:
        backoff = self.backoff_initial
        while not self._stopping:
            started = time.monotonic()
            await self._spawn()
            assert self.proc is not None
            code = await self.proc.wait()
            if self._stopping:
                return
            if (self.on_failed_start is not None and self.restarts == 0 and code > 0
                    and time.monotonic() - started < FAILED_START_S):
                log.error("%s exited with %s right after its start: not restarting it", self.name, code)
                self.on_failed_start(code)
                return
            if time.monotonic() - started > 60:
                backoff = self.backoff_initial  # it ran fine for a while: start the backoff over
            self.restarts += 1
            log.error("%s exited with %s; restarting in %.1fs (restart #%d)", self.name, code, backoff, self.restarts)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.backoff_max)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the running child, if any (SIGHUP: a reload)."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)

    def terminate(self) -> None:
        """Stop restarting it and send it SIGTERM (:meth:`stop` waits for it)."""
        self._stopping = True
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)

    async def stop(self) -> None:
        self.terminate()
        proc = self.proc
        if proc is not None and proc.returncode is None:
            try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that lands as the exit does
                async with asyncio.timeout(self.stop_timeout):
                    await proc.wait()
            except TimeoutError:
                log.warning("%s did not stop within %.0fs: killing it", self.name, self.stop_timeout)
                proc.kill()
                await proc.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        log.info("%s stopped", self.name)

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name=f"supervise {self.name}")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ChildSupervisor]:
        self.start()
        try:
            yield self
        finally:
            await self.stop()


def engine_supervisor(engine_argv: list[str]) -> ChildSupervisor:
    """The engine worker of ``tokenfan serve`` (``python -m engine_worker …``)."""
    return ChildSupervisor(["-m", "engine_worker", *engine_argv], name="engine worker")


def worker_secrets(config: GatewayConfig) -> tuple[GatewayConfig, dict[str, str]]:
    """The workers' config without its secrets, and the environment that gives them to every worker: the API
    keys and one stream-token secret for the whole server (``--token-secret``, else a random one made here), so
    a stream URL one worker signs opens on any other. Environment, not argv: ``ps`` shows every user a
    process's command line, its environment only to its owner. With ``--token-secret-file`` each worker
    reads the file."""
    from tokenfan_settings import BY_NAME

    env: dict[str, str] = {}
    if config.api_keys:
        env[BY_NAME["api_keys"].env_var] = ",".join(config.api_keys)
    if config.token_secret_file is None:
        env[BY_NAME["token_secret"].env_var] = config.token_secret or secrets.token_urlsafe(32)
    return dataclasses.replace(config, api_keys=(), token_secret=None), env


def run_workers(config: GatewayConfig, engine_argv: list[str] | None) -> int:
    """The top process of a ``--workers N`` server (see the module docstring); returns its exit code."""
    from gateway.scaleout.workers import WORKER_INDEX_ENV
    from tokenfan_settings import to_argv

    config, private = worker_secrets(config)
    argv = ["-m", "tokenfan.cli", "gateway", *to_argv(config, "gateway")]
    stop_timeout = config.shutdown_grace + 5.0
    stop = asyncio.Event()
    failed: list[int] = []

    def failed_start(code: int) -> None:  # e.g. the port is taken: stop everything, exit with its code
        failed.append(code)
        stop.set()

    workers = [ChildSupervisor(argv, name=f"gateway worker {k}", env={**os.environ, **private, WORKER_INDEX_ENV: str(k)},
                               backoff_initial=0.5, stop_timeout=stop_timeout, on_failed_start=failed_start)
               for k in range(config.workers)]
    engine = engine_supervisor(engine_argv) if engine_argv is not None else None

    def forward_hup() -> None:  # each worker reloads its keys, secrets and certificates (gateway.http.reload)
        log.info("SIGHUP: the %d gateway workers reload", len(workers))
        for w in workers:
            w.send_signal(signal.SIGHUP)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, forward_hup)
        if engine is not None:
            engine.start()
        for w in workers:
            w.start()
        log.info("%d gateway workers on port %d%s", len(workers), config.port,
                 ", with their engine" if engine is not None else "")
        await stop.wait()
        log.info("stopping: the gateway workers drain, then the engine stops")
        for w in workers:
            w.terminate()  # all at once: each drains for --shutdown-grace
        await asyncio.gather(*(w.stop() for w in workers))
        if engine is not None:
            await engine.stop()

    asyncio.run(main())
    return failed[0] if failed else 0
