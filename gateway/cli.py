"""``tokenfan``: serve (engine + gateway), gateway, engine, bench, prepare-model."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from engine_worker.config import EngineConfig, add_engine_arguments, default_runtime_dir, env
from gateway.server import run_gateway

log = logging.getLogger("tokenfan")


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def engine_argv(c: EngineConfig) -> list[str]:
    """The ``python -m engine_worker`` arguments that reproduce an EngineConfig."""
    argv = ["--engine", c.backend, "--address", c.address, "--cache-dir", str(c.cache_dir),
            "--max-model-len", str(c.max_model_len), "--dtype", c.dtype, "--kv-cache-gib", str(c.kv_cache_gib),
            "--tensor-parallel-size", str(c.tensor_parallel_size),
            "--pipeline-parallel-size", str(c.pipeline_parallel_size),
            "--enforce-eager", str(c.enforce_eager), "--gpu-memory-utilization", str(c.gpu_memory_utilization),
            "--synthetic-ttft-ms", str(c.synthetic_ttft_ms), "--synthetic-tokens-per-s", str(c.synthetic_tokens_per_s),
            "--synthetic-token-chars", str(c.synthetic_token_chars),
            "--max-queue", str(c.max_queue)]
    if c.model:
        argv += ["--model", c.model]
    if c.chat_template:
        argv += ["--chat-template", c.chat_template]
    return argv


def cmd_serve(ns: argparse.Namespace) -> int:
    from engine_worker.config import engine_config_from_args
    from gateway.config import gateway_config_from_args
    from gateway.supervisor import EngineSupervisor

    address = ns.engine_address or f"ipc://{default_runtime_dir() / f'engine-{ns.port}.sock'}"
    econf = engine_config_from_args(ns, address)
    gconf = gateway_config_from_args(ns, address)
    supervisor = EngineSupervisor(engine_argv(econf) + ["--log-level", ns.log_level])

    @contextlib.asynccontextmanager
    async def with_engine(gw: Any) -> AsyncIterator[None]:
        async with supervisor.running():
            yield

    log.info("tokenfan serve: engine=%s on %s, gateway on http://%s:%d", econf.backend, address, ns.host, ns.port)
    run_gateway(gconf, with_engine)
    return 0


def cmd_gateway(ns: argparse.Namespace) -> int:
    from gateway.config import gateway_config_from_args

    engines = ",".join(ns.engine_address or [env("engine_address", "")])
    run_gateway(gateway_config_from_args(ns, engines))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:
        from engine_worker.__main__ import main as engine_main

        return engine_main(argv[1:])
    if argv[:1] == ["bench"]:
        from tokenfan_bench.cli import main as bench_main  # type: ignore[import-not-found]

        return int(bench_main(argv[1:]))
    if argv[:1] == ["keys"]:
        from pathlib import Path

        from engine_worker.curve import generate

        if len(argv) != 2 or argv[1].startswith("-"):
            print("usage: tokenfan keys DIR   (CURVE key pairs for tcp:// engine links)", file=sys.stderr)
            return 2
        print(generate(Path(argv[1])))
        return 0
    if argv[:1] == ["certs"]:
        from gateway.certs import main as certs_main

        return certs_main(argv[1:])
    if argv[:1] == ["prepare-model"]:
        from engine_worker.models import main as models_main  # type: ignore[attr-defined]

        return int(models_main(argv[1:]) or 0)

    from gateway.config import add_gateway_arguments

    parser = argparse.ArgumentParser(prog="tokenfan", description="Token-streaming gateway for LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run an engine worker and the gateway together")
    add_gateway_arguments(serve)
    add_engine_arguments(serve)
    serve.add_argument("--engine-address", default=env("engine_address", None),
                       help="engine socket (default: a private ipc:// socket per port) [TOKENFAN_ENGINE_ADDRESS]")
    gw = sub.add_parser("gateway", help="run a gateway attached to a running engine")
    add_gateway_arguments(gw)
    gw.add_argument("--engine", dest="engine_address", action="append",
                    required=env("engine_address", None) is None,
                    help="engine address, e.g. ipc:///run/tokenfan/engine.sock; several engines: comma-separated "
                         "or repeated --engine, new requests go to the least-loaded healthy one "
                         "[TOKENFAN_ENGINE_ADDRESS]")
    sub.add_parser("engine", help="run an engine worker (see `tokenfan engine --help`)")
    sub.add_parser("bench", help="A/B transport benchmark (see `tokenfan bench --help`)")
    sub.add_parser("prepare-model", help="prepare the default model into the cache")
    sub.add_parser("keys", help="create CURVE keys for tcp:// engine links: tokenfan keys DIR")
    sub.add_parser("certs", help="create a self-signed TLS certificate for https: tokenfan certs DIR")
    ns = parser.parse_args(argv)
    _logging(ns.log_level)
    if ns.command == "serve":
        return cmd_serve(ns)
    return cmd_gateway(ns)


if __name__ == "__main__":
    sys.exit(main())
