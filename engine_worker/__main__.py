"""``python -m engine_worker`` / ``tokenfan engine``: run one engine worker process."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from engine_worker.backends.base import Backend
from engine_worker.config import EngineConfig, add_engine_arguments, engine_config
from engine_worker.ipc import sweep_stale
from engine_worker.tracing import EngineTracer
from tokenfan_settings import SettingError, default_runtime_dir, resolve

log = logging.getLogger("engine_worker")


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now (the started backend: vLLM, torch, the tokenizer) to the
    permanent generation, which no collection scans; returns how many. ``vllm serve``'s API server does the
    same once it started (vLLM's ``freeze_gc_heap``). Without it a full collection while serving scanned that
    whole heap: 400 ms pauses of this process, in which no request got a token (docs/vs-vllm.md, 2026-11-29)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def build_backend(config: EngineConfig) -> Backend:
    if config.backend == "synthetic":
        from engine_worker.backends.synthetic import SyntheticBackend

        return SyntheticBackend(config)
    from engine_worker.backends.vllm import VllmBackend

    return VllmBackend(config)


async def run_engine(config: EngineConfig) -> None:
    """Start the backend, serve until SIGINT/SIGTERM, then shut down."""
    from engine_worker.server import EngineServer

    # The one sweep of the runtime directory, before anything of this process is in it: what killed engines,
    # gateways and serves left there (their sockets, adoption claims, vLLM socket directories). `tokenfan
    # serve` and `tokenfan engine` both run it here, in their engine worker.
    sweep_stale(default_runtime_dir())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tracer = EngineTracer.start(config)  # before the backend: vLLM reads the environment it prepares
    backend = build_backend(config)
    await backend.start()
    log.info("froze the startup heap: %d objects", freeze_startup_heap())
    server = EngineServer(backend=backend, address=config.engine_address, max_queue=config.max_queue,
                          gateway_grace=config.gateway_grace,
                          allow_remote_tcp=config.allow_remote_engine, curve_dir=config.curve_dir,
                          stream_interval=config.stream_interval, tracer=tracer)
    try:
        await server.serve(stop)
    finally:
        gc.unfreeze()  # the shutdown's own collection must reach the backend's objects (VllmBackend.shutdown)
        await backend.shutdown()
        if tracer is not None:
            tracer.shutdown()


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    """uvloop when installed (as the gateway and vllm serve run): its timers and task wake-ups cost about
    half of asyncio's on the engine's per-step path."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan engine", description="Run a tokenfan engine worker.")
    add_engine_arguments(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    ns = ap.parse_args(argv)
    try:
        config = engine_config(resolve(ns, "engine"))
    except SettingError as exc:
        ap.error(str(exc))
    if "," in config.engine_address:
        ap.error(f"an engine binds one address, got {config.engine_address!r}")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _event_loop_runner()(run_engine(config))
    except (ValueError, TypeError, PermissionError, FileNotFoundError) as exc:  # a bad setting or file
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":  # vLLM spawns worker processes: the guard is required
    sys.exit(main())
