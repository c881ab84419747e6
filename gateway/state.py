"""What every route shares: the :class:`Gateway` (config, engine link, stream hub, metrics) and admission."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.api.openai_api import ChunkBuilder, ParsedRequest, new_id
from gateway.config import GatewayConfig
from gateway.core.engine_pool import EnginePool
from gateway.core.metrics import Metrics
from gateway.core.streams import SlowConsumerPolicy, StreamHub, Watchdog
from gateway.errors import APIError, EngineError, engine_unavailable
from gateway.http.clients import Holdings, fair_refusal

if TYPE_CHECKING:
    from gateway.core.engine_client import RequestHandle
    from gateway.scaleout.peers import Peers
    from gateway.scaleout.protocols import Publisher, StreamBroker

log = logging.getLogger(__name__)


class LoopMonitor:
    """How late the event loop runs: the overshoot of a short periodic sleep, over the last ``window`` s.

    ``lag`` is the worst tick of the window (``tokenfan_event_loop_lag_seconds``). ``sustained``, what
    admission compares with ``--max-loop-lag``, is the median of the ticks' *busy* overshoot: the part of the
    lateness the loop's own work explains, at most the CPU its thread used during the tick. Time the process
    did not run (stopped, descheduled on a busy host, waiting on a page fault) is not work: a stall shows in
    ``lag`` and never in ``sustained``, however many stalls the window holds (two stalls a tick apart used to
    fill the median of a three-tick window). A loop behind on most ticks because of its work raises both. A
    gateway that is behind would only deliver everything later, failure notices included, so it refuses new
    work instead."""

    def __init__(self, interval: float = 0.05, window: float = 1.0) -> None:
        self.interval = interval
        self.window = window
        self.lag = 0.0
        self.sustained = 0.0
        self._recent: collections.deque[tuple[float, float, float]] = collections.deque()  # (at, overshoot, busy)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-monitor")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def record(self, at: float, overshoot: float, cpu: float | None = None) -> None:
        """Add one tick: ``overshoot`` s late, ``cpu`` s of the loop thread's CPU during it (None: all of the
        overshoot was work). Keeps the window (never fewer than 3 ticks, so a loop slower than one tick per
        window still has a median)."""
        busy = overshoot if cpu is None else min(overshoot, cpu)
        self._recent.append((at, overshoot, busy))
        while len(self._recent) > 3 and at - self._recent[0][0] > self.window:
            self._recent.popleft()
        self.lag = max(v for _, v, _ in self._recent)
        worked = sorted(b for _, _, b in self._recent)
        self.sustained = worked[len(worked) // 2]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t, cpu = loop.time(), time.thread_time()
            await asyncio.sleep(self.interval)
            now = loop.time()
            self.record(now, max(0.0, now - t - self.interval), time.thread_time() - cpu)


@dataclass
class Gateway:
    """Everything the routes share (owned by the app's lifespan)."""

    config: GatewayConfig
    engine: EnginePool
    metrics: Metrics = field(default_factory=Metrics)
    hub: StreamHub = field(init=False)
    policy: SlowConsumerPolicy = field(init=False)
    watchdog: Watchdog = field(init=False)
    broker: StreamBroker | None = None  # other gateways' streams: Redis (--broker) or the peer workers (--workers)
    publisher: Publisher | None = None  # --broker: this gateway's listed streams, written to Redis
    peers: Peers | None = None  # --workers: the other workers (their metrics merged into /metrics)
    draining: bool = False
    listening: bool = field(init=False)  # --workers: on the shared port yet (gateway.http.server.listen_when_ready)
    clients: Holdings = field(default_factory=Holdings)  # per client: connections, generations, subscriptions
    loop: LoopMonitor = field(default_factory=LoopMonitor)
    _overload_logged_at: float = field(default=float("-inf"), repr=False)

    def __post_init__(self) -> None:
        self.hub = StreamHub(self.config.retention)
        self.listening = self.config.workers <= 1
        self.policy = self.config.policy
        self.watchdog = Watchdog(self.policy.send_timeout, self.config.keepalive_interval)
        if self.config.inject_delay:
            self.metrics.hot.inject(self.config.inject_delay)

    def cancel_local_stream(self, stream_id: str) -> bool:
        """Cancel a generation this gateway runs (a broker-forwarded DELETE); False if not ours."""
        from gateway.core.delivery import cancel

        s = self.hub.streams.get(stream_id)
        return s is not None and cancel(s)

    def in_flight(self) -> int:
        """Generations this gateway is still waiting on the engine for."""
        return sum(c.in_flight for c in self.engine.clients)

    def end_all_streams(self) -> None:
        """Shutdown deadline: fail every in-flight generation with an explicit error."""
        err = APIError(503, "The server is shutting down; retry on another instance.", type="server_error",
                       code="server_shutdown", retry_after=1.0)
        n = self.engine.fail_all(err)
        if n:
            log.warning("shutdown grace period over: ended %d in-flight generations with server_shutdown", n)

    @property
    def model_id(self) -> str | None:
        return self.config.served_model_name or self.engine.model

    def check_model(self, requested: str | None) -> str:
        if self.draining:
            raise APIError(503, "The server is shutting down.", type="server_error", code="server_shutdown",
                           retry_after=1.0)
        served = self.model_id
        if served is None or not self.engine.healthy:
            raise engine_unavailable()
        if requested is not None and requested != served:
            raise APIError(404, f"The model `{requested}` does not exist. This server serves `{served}`.",
                           param="model", code="model_not_found")
        return served

    def refused(self, err: APIError) -> APIError:
        """Count a refusal by its code (``tokenfan_refusals_total``); returns it, to raise."""
        self.metrics.refusals.labels(err.code or "unknown").inc()
        return err

    def _admit(self, client: str, key: str | None) -> None:
        """Raise (and count) the refusal a new generation of ``client`` gets, if any: overload, the gateway's
        total, the client's own limits, then fair admission (:func:`gateway.http.clients.fair_refusal`)."""
        try:
            self._check_admission(client, key)
        except APIError as err:
            raise self.refused(err) from None

    def _check_admission(self, client: str, key: str | None) -> None:
        max_lag = self.config.max_loop_lag
        lag = self.loop.sustained
        if max_lag and lag > max_lag:
            now = time.monotonic()
            if now - self._overload_logged_at > 1.0:  # rate-limited: one line per second of refusals
                self._overload_logged_at = now
                log.warning("refusing new work: event loop %.0f ms behind (median of the last second; "
                            "--max-loop-lag %.0f ms)", lag * 1000, max_lag * 1000)
            raise APIError(503, f"The gateway is overloaded (event loop {lag * 1000:.0f} ms behind; the "
                                f"limit is {max_lag * 1000:.0f} ms); retry shortly.", type="server_error",
                           code="overloaded", retry_after=1.0)
        held = self.clients
        total = held.totals["generations"]
        if total >= self.config.max_concurrent:
            raise APIError(429, f"Too many concurrent generations ({total}); the limit is "
                                f"{self.config.max_concurrent}.", type="rate_limit_error",
                           code="too_many_requests", retry_after=1.0)
        per_key = self.config.max_concurrent_per_key
        mine = held.of("generations", client)
        if per_key and key is not None and mine >= per_key:
            raise APIError(429, f"This API key has {mine} generations in flight; the limit is "
                                f"{per_key}.", type="rate_limit_error", code="too_many_requests", retry_after=1.0)
        held.check("generations", client, self.config.max_generations_per_client)
        soft = int(self.config.max_concurrent * self.config.fair_share_at) if self.config.fair_share_at else 0
        why = fair_refusal(mine, total, held.clients("generations"), soft,
                           engines_queue=mine > 0 and self.engine.load()[1] > 0)
        if why is not None:
            raise APIError(429, why + "; retry shortly.", type="rate_limit_error", code="fair_share_limit",
                           retry_after=1.0)

    async def open(self, parsed: ParsedRequest, scope: Any = None) -> tuple[RequestHandle, ChunkBuilder]:
        """Submit to the engine and wait until it accepted (prompt validated).

        Raises APIError or EngineError. ``scope`` (of the HTTP request or WebSocket) supplies the API key
        for per-key limits and the request id the engine logs as ``trace``; the generation id is recorded
        for the access log."""
        state = scope.setdefault("state", {}) if scope is not None else {}
        key = state.get("api_key")
        client = state.get("client") or "internal"  # set by gateway.http.clients.ClientLimitMiddleware
        model = self.check_model(parsed.model)
        self._admit(client, key)
        rid = new_id(parsed.endpoint)
        handle = self.engine.submit(parsed.to_submit(rid, trace_id=state.get("request_id", rid)))
        state["generation_id"] = rid
        self.clients.acquire("generations", client)
        handle.on_close.append(lambda: self.clients.release("generations", client))
        try:
            prompt_tokens = await handle.wait_accepted(self.config.accept_timeout)
            limit = self.config.max_prompt_tokens
            if limit and prompt_tokens > limit:
                raise APIError(400, f"The prompt has {prompt_tokens} tokens; this server accepts at most {limit}.",
                               param="messages" if parsed.endpoint == "chat.completions" else "prompt",
                               code="prompt_too_long")
        except EngineError as exc:
            handle.close()
            if exc.code == "engine_overloaded":
                self.metrics.refusals.labels(exc.code).inc()
            raise
        except BaseException:
            handle.close()
            raise
        return handle, ChunkBuilder(parsed.endpoint, rid, model, parsed.include_usage)
