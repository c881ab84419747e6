"""What every route shares: the :class:`Gateway` (config, engine link, the delivery core's parts, admission)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.admission import Admission, Holdings, LoopMonitor
from gateway.config import GatewayConfig
from gateway.core.backpressure import SlowConsumerPolicy
from gateway.core.delivery import Delivery, cancel, hand_over
from gateway.core.engine_pool import EnginePool
from gateway.core.follow import Watchdog
from gateway.core.metrics import Metrics
from gateway.core.streams import StreamHub
from gateway.errors import APIError, ClientError, Refusal, engine_unavailable

if TYPE_CHECKING:
    from gateway.core.ports import Publisher, RemoteStreams
    from gateway.core.tracing import Tracer
    from gateway.scaleout.peers import Peers

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    """Everything the routes share (owned by the app's lifespan)."""

    config: GatewayConfig
    engine: EnginePool
    metrics: Metrics = field(default_factory=Metrics)
    hub: StreamHub = field(init=False)
    policy: SlowConsumerPolicy = field(init=False)
    watchdog: Watchdog = field(init=False)
    delivery: Delivery = field(init=False)  # the core's parts: hub, metrics, policy, watchdog, publisher, remote
    admission: Admission = field(init=False)
    peers: Peers | None = None  # --workers: the other workers (their metrics merged into /metrics)
    tracer: Tracer | None = None  # --otlp-traces-endpoint: each generation's span (gateway.telemetry); None: off
    draining: bool = False
    listening: bool = field(init=False)  # --workers: on the shared port yet (gateway.http.server.listen_when_ready)

    def __post_init__(self) -> None:
        self.hub = StreamHub(self.config.retention)
        self.listening = self.config.workers <= 1
        self.policy = self.config.policy
        self.watchdog = Watchdog(self.policy.send_timeout, self.config.keepalive_interval)
        if self.config.inject_delay:
            self.metrics.hot.inject(self.config.inject_delay)
        self.delivery = Delivery(self.hub, self.metrics, self.policy, self.watchdog,
                                 inject_delay=self.config.inject_delay, direct_write=self.config.direct_write,
                                 detach=self.config.detach_subscribers)
        self.admission = Admission(self.config)

    @property
    def remote(self) -> RemoteStreams | None:
        """Other gateways' streams: through Redis (``--broker``) or the peer workers (``--workers``)."""
        return self.delivery.remote

    @remote.setter
    def remote(self, value: RemoteStreams | None) -> None:
        self.delivery.remote = value

    @property
    def publisher(self) -> Publisher | None:
        """Where this gateway's listed streams are written for the others: Redis (``--broker``) or, for
        ``--workers`` without one, the peer workers (they keep standbys and adopt each other's streams)."""
        return self.delivery.publisher

    @publisher.setter
    def publisher(self, value: Publisher | None) -> None:
        self.delivery.publisher = value

    @property
    def clients(self) -> Holdings:
        """Per client: connections, generations, subscriptions."""
        return self.admission.clients

    @property
    def loop(self) -> LoopMonitor:
        return self.admission.loop

    def cancel_local_stream(self, stream_id: str) -> bool:
        """Cancel a generation this gateway runs (a broker-forwarded DELETE); False if not ours."""
        s = self.hub.streams.get(stream_id)
        return s is not None and cancel(s)

    def hand_over(self) -> list[asyncio.Task[None]]:
        """SIGTERM with ``--handover`` and a broker: every local listed stream still generating ends here
        ``moved`` (see :func:`gateway.core.delivery.hand_over`); the pumps that are ending them."""
        return [s.task for s in list(self.hub.streams.values()) if hand_over(s) and s.task is not None]

    def in_flight(self) -> int:
        """Generations this gateway is still waiting on the engine for."""
        return sum(c.in_flight for c in self.engine.clients)

    def end_all_streams(self) -> int:
        """Shutdown deadline: fail every in-flight generation with an explicit error; how many there were."""
        err = Refusal(503, "The server is shutting down; retry on another instance.", type="server_error",
                       code="server_shutdown", retry_after=1.0)
        n = self.engine.fail_all(err)
        if n:
            log.warning("shutdown grace period over: ended %d in-flight generations with server_shutdown", n)
        return n

    @property
    def model_id(self) -> str | None:
        return self.config.served_model_name or self.engine.model

    def check_model(self, requested: str | None) -> str:
        if self.draining:
            raise Refusal(503, "The server is shutting down.", type="server_error", code="server_shutdown",
                           retry_after=1.0)
        served = self.model_id
        if served is None or not self.engine.healthy:
            raise engine_unavailable()
        if requested is not None and requested != served:
            raise ClientError(404, f"The model `{requested}` does not exist. This server serves `{served}`.",
                           param="model", code="model_not_found")
        return served

    def refused(self, err: APIError) -> APIError:
        """Count a refusal by its code (``tokenfan_refusals_total``); returns it, to raise."""
        self.metrics.refusals.labels(err.code or "unknown").inc()
        return err

    def admit(self, client: str, key: str | None) -> None:
        """Raise (and count) the refusal a new generation of ``client`` gets, if any
        (:meth:`gateway.admission.Admission.check`)."""
        try:
            self.admission.check(client, key, engines_queue=self.engine.load()[1] > 0)
        except APIError as err:
            raise self.refused(err) from None
