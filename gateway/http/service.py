"""Service endpoints: ``/livez``, ``/readyz``, ``/health``, ``/metrics``, ``/v1/time`` and the pages.

The probes (docs/deploy.md): ``/livez`` is liveness (the process and its event loop answer: nothing else is
asked); ``/readyz`` is readiness (this replica serves what most traffic needs: its engine link is up and it is
not draining). Neither asks Redis: a broker every replica shares must not take every replica out of a Service
at once, and unlisted traffic (POST SSE, ``/v1/ws``, foreground responses) does not need it. ``/health`` is for
people and whole-deployment checks: 200 only when everything this gateway uses answers, the broker included."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from engine_worker import protocol as p
from gateway.api.edge import gateway_of
from gateway.state import Gateway
from tokenfan_settings.release import __version__


def limits(gw: Gateway) -> dict[str, int | float]:
    """The limits a load generator must fit in (``/health``'s ``limits``; docs/limits.md), by setting name;
    ``0`` = no limit for the per-client ones and ``fair_share_at``."""
    c = gw.config
    return {"max_generations_per_client": c.max_generations_per_client,
            "max_connections_per_client": c.max_connections_per_client,
            "max_subscriptions_per_client": c.max_subscriptions_per_client,
            "max_concurrent": c.max_concurrent, "max_concurrent_per_key": c.max_concurrent_per_key,
            "fair_share_at": c.fair_share_at, "max_streams": c.retention.max_streams,
            "max_subscribers": c.retention.max_subscribers, "max_tokens_cap": c.limits.max_tokens_cap,
            "ws_max_in_flight": c.ws_max_in_flight, "ws_max_queued": c.ws_max_queued}


async def livez(request: Request) -> Response:
    """Liveness: 200 whenever the event loop runs this handler (draining included: a restart would cut the
    streams it drains). Asks nothing of the engine or Redis."""
    return JSONResponse({"status": "ok"}, headers={"Cache-Control": "no-store"})


@dataclass(frozen=True, slots=True)
class Facts:
    """What the conditions read that costs a request to learn, read once per probe."""

    workers_listening: int = 0  # the other workers that listen on the shared port (--workers)
    workers_serving: int = 0  # of those, the ones whose engine link is up


@dataclass(frozen=True, slots=True)
class Condition:
    """One thing ``/readyz`` or ``/health`` asks; docs/reference.md's probe table is made from :data:`CONDITIONS`."""

    reason: str  # /readyz's ``reason`` when it fails
    asked_by: tuple[str, ...]  # "readyz", "health"
    holds_when: str
    holds: Callable[[Gateway, Facts], bool]


def _workers_ready(gw: Gateway, facts: Facts) -> bool:
    return gw.config.workers <= 1 or facts.workers_serving == facts.workers_listening


CONDITIONS: tuple[Condition, ...] = (
    Condition("draining", ("readyz",), "the gateway is not draining (SIGTERM; `/health` does not ask)",
              lambda gw, _: not gw.draining),
    Condition("engine", ("readyz", "health"), "the engine link is up: a heartbeat came within `--heartbeat-timeout`",
              lambda gw, _: gw.engine.healthy and gw.engine.last_heartbeat is not None),
    Condition("workers", ("readyz", "health"), "with `--workers`: every other worker that listens on the shared "
              "port has its engine link up (the kernel may hand a request to any of them)", _workers_ready),
    Condition("broker", ("health",), "with `--broker`: Redis takes writes and this gateway holds its lease "
              "(`broker` is `ok`); `/readyz` does not ask: every replica shares Redis",
              lambda gw, _: broker_state(gw) in (None, "ok")),
)


async def facts_of(gw: Gateway) -> Facts:
    if gw.config.workers <= 1:
        return Facts()
    from gateway.scaleout.peers import peers_ready
    from gateway.scaleout.workers import worker_index

    listening, serving = await peers_ready(gw.config.port, gw.config.workers, worker_index())
    return Facts(listening, serving)


def failing(gw: Gateway, facts: Facts, probe: str) -> list[str]:
    """The reasons of the conditions ``probe`` asks that do not hold, in :data:`CONDITIONS`' order."""
    return [c.reason for c in CONDITIONS if probe in c.asked_by and not c.holds(gw, facts)]


async def readyz(request: Request) -> Response:
    """Readiness: 200 while this gateway can serve unlisted traffic (:data:`CONDITIONS` asked by ``readyz``).
    Redis is not asked (see the module docstring); a gateway whose broker is away or that fenced itself is
    ready (its listed streams answer 503 meanwhile). Else 503 + Retry-After, ``reason``: the first that fails."""
    gw: Gateway = gateway_of(request)
    reasons = failing(gw, await facts_of(gw), "readyz")
    if not reasons:
        return JSONResponse({"status": "ready"}, headers={"Cache-Control": "no-store"})
    return JSONResponse({"status": "unavailable", "reason": reasons[0]}, status_code=503,
                        headers={"Retry-After": "1", "Cache-Control": "no-store"})


def broker_state(gw: Gateway) -> str | None:
    """``--broker``: ``ok``, ``unavailable`` (Redis unreachable, or this gateway fenced itself) or ``full``
    (Redis refuses writes: out of memory); None without a broker."""
    if not gw.config.broker_url:
        return None
    from gateway.scaleout.broker import Broker

    return gw.publisher.state() if isinstance(gw.publisher, Broker) else "unavailable"


def heap_state(state: Any) -> dict[str, int]:
    """The collector's view of this process for ``/health``: objects frozen (never scanned), objects tracked
    (what a full collection scans now), and how often the live heap was frozen and thawed
    (:mod:`gateway.http.heap`)."""
    heap = getattr(state, "heap", None)
    return {"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()),
            "freezes": heap.freezes if heap is not None else 0, "thaws": heap.thaws if heap is not None else 0}


async def health(request: Request) -> Response:
    """200 when every :data:`CONDITIONS` asked by ``health`` holds (else 503 + Retry-After; ``workers`` says
    how many are ready, ``broker`` the broker's state: :func:`broker_state`). ``limits`` gives the admission
    limits of this gateway (per process), ``version`` and ``protocol`` its release and wire protocol, ``gc``
    the collector's view (:func:`heap_state`), ready or not. For people and dashboards; the probes are
    :func:`livez` and :func:`readyz`."""
    gw: Gateway = gateway_of(request)
    hb = gw.engine.last_heartbeat
    engines = gw.engine.status()
    extra: dict[str, Any] = {"version": __version__, "protocol": p.MAGIC.decode(), "limits": limits(gw),
                             "gc": heap_state(request.app.state)}
    facts = await facts_of(gw)
    ready = not failing(gw, facts, "health")
    broker = broker_state(gw)
    if broker is not None:
        extra["broker"] = broker
    if gw.config.workers > 1:
        extra["workers"] = {"configured": gw.config.workers, "listening": facts.workers_listening + gw.listening,
                            "ready": facts.workers_serving + (gw.listening and gw.engine.healthy)}
    if ready and hb is not None:
        running, waiting = gw.engine.load()
        return JSONResponse({"status": "ok", "engine": {"id": hb.engine_id, "backend": hb.backend,
                                                        "model": hb.model, "running": running,
                                                        "waiting": waiting}, "engines": engines, **extra})
    return JSONResponse({"status": "unavailable", "engine": None, "engines": engines, **extra}, status_code=503,
                        headers={"Retry-After": "1"})


async def metrics(request: Request) -> Response:
    gw: Gateway = gateway_of(request)
    refresh_metrics(gw)
    own = gw.metrics.render()
    if gw.peers is not None:  # --workers: every worker's metrics in one scrape
        own = await gw.peers.merged_metrics(own)
    return Response(own, media_type=gw.metrics.content_type)


def refresh_metrics(gw: Gateway) -> None:
    """Set the gauges that are read from the engine link at scrape time."""
    m = gw.metrics
    m.engine_up.set(1 if gw.engine.healthy else 0)
    for client in gw.engine.clients:
        m.engine_link_up.labels(client.address).set(1 if client.healthy else 0)
    running, waiting = gw.engine.load()
    m.engine_running.set(running)
    m.engine_queue.set(waiting)
    m.bad_frames.set(gw.engine.bad_frames)
    m.loop_lag.set(gw.loop.lag)
    m.broker_serving.set(1 if gw.publisher is None or gw.publisher.serving() else 0)
    if gw.engine.last_heartbeat is not None:
        m.engine_bad_frames.set(gw.engine.last_heartbeat.bad_frames)


async def server_time(request: Request) -> Response:
    """The gateway's clock, for NTP-style offset estimation by browser pages."""
    return Response(b'{"time_ns":%d}' % p.now_ns(), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


def web_dir() -> Path | None:
    """The pages: ``web/`` ships in the wheel as the ``tokenfan_web`` package (see pyproject.toml)."""
    spec = importlib.util.find_spec("tokenfan_web")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / "index.html").is_file():
            return Path(loc)
    return None


def page_routes() -> list[Any]:
    web = web_dir()
    if web is None:
        return []
    return [Route("/", lambda r: FileResponse(web / "index.html"), methods=["GET"]),
            Route("/ab", lambda r: FileResponse(web / "ab.html"), methods=["GET"]),
            Mount("/web", StaticFiles(directory=web), name="web")]
