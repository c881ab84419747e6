"""``python -m engine_worker`` / ``tokenfan engine``: run one engine worker process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from engine_worker.backends.base import Backend
from engine_worker.config import (
    EngineConfig,
    add_engine_arguments,
    default_engine_address,
    engine_config_from_args,
    env,
)

log = logging.getLogger("engine_worker")


def build_backend(config: EngineConfig) -> Backend:
    if config.backend == "synthetic":
        from engine_worker.backends.synthetic import SyntheticBackend

        return SyntheticBackend(config)
    from engine_worker.backends.vllm import VllmBackend

    return VllmBackend(config)


async def run_engine(config: EngineConfig) -> None:
    """Start the backend, serve until SIGINT/SIGTERM, then shut down."""
    from engine_worker.server import EngineServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    backend = build_backend(config)
    await backend.start()
    server = EngineServer(backend=backend, address=config.address, max_queue=config.max_queue,
                          allow_remote_tcp=config.allow_remote_tcp, curve_dir=config.curve_dir)
    try:
        await server.serve(stop)
    finally:
        await backend.shutdown()


def add_address_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=env("engine_address", default_engine_address()),
                        help="ZeroMQ address to bind: ipc://PATH or tcp://HOST:PORT [TOKENFAN_ENGINE_ADDRESS]")
    parser.add_argument("--allow-remote-engine", action="store_true", default=env("allow_remote_engine", False, bool),
                        help="allow binding tcp:// to a non-loopback address [TOKENFAN_ALLOW_REMOTE_ENGINE]")
    parser.add_argument("--curve-dir", type=Path, default=env("curve_dir", None, Path),
                        help="CURVE keys (from `tokenfan keys DIR`): encrypt the link and admit only "
                             "authorized gateways [TOKENFAN_CURVE_DIR]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenfan engine", description="Run a tokenfan engine worker.")
    add_engine_arguments(parser)
    add_address_arguments(parser)
    parser.add_argument("--log-level", default=env("log_level", "INFO"), help="[TOKENFAN_LOG_LEVEL]")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config_from_args(ns, ns.address)
    config.allow_remote_tcp = ns.allow_remote_engine
    config.curve_dir = ns.curve_dir
    try:
        asyncio.run(run_engine(config))
    except (ValueError, PermissionError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":  # vLLM spawns worker processes: the guard is required
    sys.exit(main())
