"""``tokenfan``: serve (engine + gateway), gateway, engine, probe, bench, prepare-model."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gateway.core.tracing import TraceIds
from gateway.http.server import run_gateway
from tokenfan_settings import SettingError, add_arguments, default_runtime_dir, given, release, resolve

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

log = logging.getLogger("tokenfan")


def _logging(level: str) -> None:
    """Plain lines; a line about a traced generation ends with its trace and span ids (``%(trace)s``:
    :class:`gateway.core.tracing.TraceIds`, docs/observability.md)."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s%(trace)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceIds())


def cmd_serve(values: dict[str, Any], gconf: GatewayConfig) -> int:
    from engine_worker.config import engine_argv, engine_config
    from tokenfan.supervisor import engine_supervisor, run_workers

    econf = engine_config(values)
    log.info("tokenfan serve: engine=%s on %s, gateway on http://%s:%d", econf.backend, econf.engine_address,
             gconf.host, gconf.port)
    if gconf.workers > 1:
        return run_workers(gconf, engine_argv(econf))
    supervisor = engine_supervisor(engine_argv(econf))

    @contextlib.asynccontextmanager
    async def with_engine(gw: Any) -> AsyncIterator[None]:
        async with supervisor.running():
            yield

    run_gateway(gconf, with_engine)
    return 0


def cmd_gateway(gconf: GatewayConfig) -> int:
    """``tokenfan gateway``: one gateway process, or (``--workers N``) the supervisor of N of them."""
    from gateway.scaleout.workers import WORKER_INDEX_ENV

    if gconf.workers > 1 and WORKER_INDEX_ENV not in os.environ:
        from tokenfan.supervisor import run_workers

        return run_workers(gconf, None)
    run_gateway(gconf)
    return 0


class _Version(argparse.Action):
    """``--version``: the release, the git commit when run from a checkout, the wire protocol and the Python
    (:func:`tokenfan_settings.release.describe`), worked out only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from engine_worker.protocol import MAGIC

        print(release.describe(MAGIC.decode()))
        parser.exit()


def top_parser() -> argparse.ArgumentParser:
    """``tokenfan``'s own parser: ``serve`` and ``gateway`` take the settings; the other commands are parsed by
    their own modules (:func:`parsers`) and named here for ``--help``."""
    parser = argparse.ArgumentParser(prog="tokenfan", description="Token-streaming gateway for LLM serving.")
    parser.add_argument("--version", action=_Version, help="print the version, commit and wire protocol, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("serve", help="run an engine worker and the gateway together"), "serve")
    add_arguments(sub.add_parser("gateway", help="run a gateway attached to running engine(s)"), "gateway")
    sub.add_parser("engine", help="run an engine worker (see `tokenfan engine --help`)")
    sub.add_parser("probe", help="ping an engine worker over its socket: the engine's liveness probe")
    sub.add_parser("bench", help="A/B transport benchmark (see `tokenfan bench --help`)")
    sub.add_parser("prepare-model", help="prepare the default model into the cache")
    sub.add_parser("keys", help="create CURVE keys for tcp:// engine links: tokenfan keys DIR")
    sub.add_parser("certs", help="create a self-signed TLS certificate for https: tokenfan certs DIR")
    return parser


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser a ``tokenfan`` command line goes through, by program (``keys`` takes no flags).

    tests/test_docs.py checks every flag the docs name against these.
    """
    from engine_worker.__main__ import parser as engine_parser
    from engine_worker.models import parser as models_parser
    from engine_worker.probe import parser as probe_parser
    from gateway.http.certs import parser as certs_parser
    from tokenfan_bench.cli import parser as bench_parser
    from tokenfan_bench.cpu.capacity import parser as capacity_parser
    from tokenfan_bench.cpu.gateway_cost import parser as cpu_parser
    from tokenfan_bench.cpu.step_pass_cost import parser as pass_parser
    from tokenfan_bench.failover import parser as failover_parser
    from tokenfan_bench.fanout import parser as fanout_parser
    from tokenfan_bench.page_levels import parser as page_levels_parser
    from tokenfan_bench.sizing import parser as sizing_parser
    from tokenfan_bench.vs_vllm import parser as vs_vllm_parser

    return {"tokenfan": top_parser(), "tokenfan engine": engine_parser(), "tokenfan probe": probe_parser(), "tokenfan bench": bench_parser(),
            "tokenfan bench vs-vllm": vs_vllm_parser(), "tokenfan bench cpu": cpu_parser(),
            "tokenfan bench pass": pass_parser(), "tokenfan bench failover": failover_parser(),
            "tokenfan bench page-levels": page_levels_parser(), "tokenfan bench fanout": fanout_parser(),
            "tokenfan bench sizing": sizing_parser(), "tokenfan bench capacity": capacity_parser(),
            "tokenfan prepare-model": models_parser("tokenfan prepare-model"), "tokenfan certs": certs_parser()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:
        from engine_worker.__main__ import main as engine_main

        return engine_main(argv[1:])
    if argv[:1] == ["probe"]:
        from engine_worker.probe import main as probe_main

        return probe_main(argv[1:])
    if argv[:1] == ["bench"]:
        from tokenfan_bench.cli import main as bench_main

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
        from gateway.http.certs import main as certs_main

        return certs_main(argv[1:])
    if argv[:1] == ["prepare-model"]:
        from engine_worker.models import main as models_main

        models_main(argv[1:], prog="tokenfan prepare-model")
        return 0

    parser = top_parser()
    ns = parser.parse_args(argv)
    try:
        values = resolve(ns, ns.command)
    except SettingError as exc:
        parser.error(str(exc))
    if ns.command == "serve":
        if "engine_address" not in given(ns, "serve"):  # two `serve`s on one machine must not share a socket
            port = values["port"]
            values["engine_address"] = f"ipc://{default_runtime_dir() / f'engine-{port}.sock'}"
        elif "," in values["engine_address"]:
            parser.error(f"serve runs one engine, got --engine-address {values['engine_address']!r}")
    from gateway.config import gateway_config

    try:
        gconf = gateway_config(values)  # also the checks across settings (e.g. the broker's lease clocks)
        if gconf.broker_url:
            from gateway.scaleout.redis_clients import parse_broker_url

            parse_broker_url(gconf.broker_url)
    except ValueError as exc:
        parser.error(str(exc))
    _logging(values["log_level"])
    if ns.command == "gateway":
        return cmd_gateway(gconf)
    return cmd_serve(values, gconf)


if __name__ == "__main__":
    sys.exit(main())
